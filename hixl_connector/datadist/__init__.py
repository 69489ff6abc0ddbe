"""LLM-DataDist v2 API (the names, defaults and status codes of CANN ``llm_datadist``).

The connector's one seam to transfer engines, in rooms by what they serve:

- ``api/``: the surface both back-ends share, with CANN's names and codes: ``status`` (codes
  and ``LLMException``), ``llm_types`` (descriptors and cache keys), ``config``
  (``LLMConfig``), ``cluster_info`` (``LLMClusterInfo``, ``LLMRole``), ``pull_handle`` (async
  pulls), ``c_types`` (CANN's C argument types), and ``rules``: one table of CANN's argument
  rules for ``pull_blocks``, ``push_blocks``, ``pull_cache`` and ``push_cache``;
- the seam itself: ``profile`` (the typed ``Backend``, the ``DataDist`` and
  ``BlocksCacheManager`` protocols the connector calls, and what each back-end needs) and
  ``backend`` (``load_backend``);
- ``native/``: the API on the project's engine: ``llm_datadist`` (``LLMDataDist``, the only
  module that loads ``hixl_connector._native``), ``cache_manager``, ``push_calls``,
  ``transfer_args`` (a checked call in the engine's form), ``write_grants``,
  ``engine_options``; its ``parity/`` holds what serves only HIXL's own samples
  (``rank_table`` links, ``transfer_async``, ``local_calls`` with ``allocations`` and
  ``local_copies``), which the connector never calls;
- ``ascend/``: CANN ``llm_datadist`` with torch_npu (``cann``), wrapped by
  ``checked_classes`` to refuse what CANN silently accepts.

``from hixl_connector.datadist import LLMDataDist, LLMConfig, ...`` gives the native-engine
implementation; ``load_backend("native" | "ascend" | "auto")`` chooses one explicitly. Importing
this package is cheap: the native engine loads on ``LLMDataDist.init``. See README.md here.
"""

from hixl_connector.datadist.api.cluster_info import LLMClusterInfo, LLMRole
from hixl_connector.datadist.api.config import LLMConfig, LlmConfig
from hixl_connector.datadist.api.llm_types import (
    BlocksCacheKey,
    BlocksPull,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    KvCache,
    MemInfo,
    Memtype,
    Placement,
    RegisterMemStatus,
)
from hixl_connector.datadist.api.pull_handle import PullHandle, ThreadPullHandle
from hixl_connector.datadist.api.status import LLMException, LLMStatusCode, Status
from hixl_connector.datadist.backend import (
    BACKENDS,
    Backend,
    BackendUnavailableError,
    load_backend,
)
from hixl_connector.datadist.native.cache_manager import CacheManager
from hixl_connector.datadist.native.llm_datadist import LLMDataDist
from hixl_connector.datadist.native.parity.transfer_async import (
    CacheTask,
    LayerSynchronizer,
    TransferConfig,
    TransferWithCacheKeyConfig,
)
from hixl_connector.datadist.profile import BlocksCacheManager, DataDist

__all__ = [
    "BACKENDS",
    "Backend",
    "BackendUnavailableError",
    "BlocksCacheKey",
    "BlocksCacheManager",
    "BlocksPull",
    "Cache",
    "CacheDesc",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "CacheManager",
    "CacheTask",
    "DataDist",
    "DataType",
    "KvCache",
    "LayerSynchronizer",
    "LLMClusterInfo",
    "LLMConfig",
    "LLMDataDist",
    "LLMException",
    "LLMRole",
    "LLMStatusCode",
    "LlmConfig",
    "MemInfo",
    "Memtype",
    "Placement",
    "PullHandle",
    "RegisterMemStatus",
    "Status",
    "ThreadPullHandle",
    "TransferConfig",
    "TransferWithCacheKeyConfig",
    "load_backend",
]
