"""STAND-IN for CANN's ``llm_datadist`` package. Not CANN, not Ascend: a test double.

It lets the connector's "ascend" back-end (``hixl_connector.datadist.ascend.cann``) run on a host
without CANN. It behaves as CANN's Python layer (``src/python/llm_datadist`` of hicann/hixl)
does, written from that layer's documented behaviour (the reference's sections 2-6) and
sharing no code with ``hixl_connector.datadist``: its types, checks and calls are its own, and
the project's C++ engine (``hixl_connector._native``) plays CANN's compiled layer. It is no
stricter than CANN's Python layer: option keys are forwarded whatever their prefix, unknown
``LLMConfig`` attributes are stored and ignored, ``pull_blocks`` reads its keyword arguments
with ``dict.get`` (a misspelt one is dropped and its default applies), and empty layer ranges
mean all layers. The project's own checks on these live in ``hixl_connector.datadist``
(``hixl_connector.datadist.ascend.checked_classes``), not here.

Where CANN decides in C++, the stand-in follows the rules the reference documents:

- a second ``LLMDataDist`` in the process: ``LLMException(LLM_FAILED)``;
- an ``llm.listenIpInfo`` that is not "ip:port" with one colon (so any IPv6): ``init`` raises
  ``LLM_PARAM_INVALID``; a host name in ``LLMClusterInfo.append_*_ip_info``: ``RuntimeError``
  without a status code (CANN converts IPv4 literals only);
- memory registered after ``link_clusters`` is not remotely accessible, so a pull into it
  raises ``LLM_PARAM_INVALID`` and a pull of it from a peer linked earlier
  ``LLM_KV_CACHE_NOT_EXIST``;
- a destination cache that is not remote-accessible: ``LLM_PARAM_INVALID``;
- a request over CANN's buffer (2 MiB with remote access, 112 KiB without): ``LLM_PARAM_INVALID``;
- a reused ``(cluster_id, model_id)`` key silently re-points to the newest cache (last wins);
- ``init`` refuses, as CANN's Python does, the HIXL transfer back-end without the cache
  manager, with remote cache access off, or without ``llm.listenIpInfo`` (``LLM_PARAM_INVALID``);
  without the cache manager there is no ``cache_manager`` (CANN's v1 API, not emulated).

The fabric (``fabric.py``): in the link mode ``HIXL_STANDIN_FABRIC`` names (``hccs-a2``,
the default, ``hccs-a3`` or ``roce``), a link fails (``LLM_LINK_FAILED``) where either side
registered device memory at a base not 2 MB aligned (HCCS) or host memory not from
``aclrtMallocHost`` (RoCE; ``malloc_host`` stands in for it), and a pull fails
(``LLM_FEATURE_NOT_ENABLED``) where the mode does not move its memories (HCCS on A2: device
to device only; on A3: no remote host memory) or moves between host and device without a
device pool of 100 MB.

Device memory is played by host memory: a ``Placement.DEVICE`` cache is taken at its word and
registered with the native engine as host memory. Nothing here proves the NPU, HCCS or RoCE
path. ``calls()`` and ``pull_kwargs()`` tell the tests what the stand-in was asked;
``set_pull_delay(s)`` makes every ``pull_blocks`` wait ``s`` first, as a slow device would, and
``delayed_pulls()`` counts the calls that began that wait.
"""

from __future__ import annotations

from .cache_manager import CacheManager, delayed_pulls, set_pull_delay
from .config import LLMConfig, LlmConfig
from .fabric import FABRIC_ENV, MODES, free_host, malloc_host
from .llm_datadist import TRANSPORT_ENV, LLMDataDist
from .llm_types import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LLMClusterInfo,
    LLMRole,
    Memtype,
    Placement,
    RegisterMemStatus,
)
from .recorder import calls, pull_kwargs
from .status import LLMException, LLMStatusCode, Status

STANDIN = True

__all__ = [
    "FABRIC_ENV",
    "MODES",
    "TRANSPORT_ENV",
    "BlocksCacheKey",
    "Cache",
    "CacheDesc",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "CacheManager",
    "DataType",
    "LLMClusterInfo",
    "LLMConfig",
    "LLMDataDist",
    "LLMException",
    "LLMRole",
    "LLMStatusCode",
    "LlmConfig",
    "Memtype",
    "Placement",
    "RegisterMemStatus",
    "Status",
    "calls",
    "delayed_pulls",
    "free_host",
    "malloc_host",
    "pull_kwargs",
    "set_pull_delay",
]
