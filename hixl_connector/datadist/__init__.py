"""LLM-DataDist v2 API (the names, defaults and status codes of CANN ``llm_datadist``).

The connector's one seam to transfer engines. What lives here:

- the API itself, implemented on the native engine: ``native`` (``LLMDataDist``, the only
  module that loads ``hixl_connector._native``; its options in ``engine_options``, its
  rank-table links in ``rank_table``), ``cache_manager``, ``config``
  (``LLMConfig``, ``LLMClusterInfo``, ``LLMRole``), ``llm_types`` (descriptors and cache
  keys), ``status`` (codes and ``LLMException``), ``pull_handle`` (async pulls),
  ``transfer_async`` (layer-wise push), ``local_calls`` with ``allocations`` and
  ``local_copies`` (the calls that stay in this process);
- CANN's argument rules: ``checks`` (types and C ranges), ``validation`` (``pull_blocks``,
  ``push_blocks``), ``cache_rows`` (``pull_cache``, ``push_cache``);
- the back-ends: ``backend`` (``load_backend``), ``profile`` (the typed ``Backend``, the
  ``DataDist`` and ``BlocksCacheManager`` protocols the connector calls, and what each
  back-end needs), ``ascend`` (CANN ``llm_datadist`` with torch_npu).

``from hixl_connector.datadist import LLMDataDist, LLMConfig, ...`` gives the native-engine
implementation; ``load_backend("native" | "ascend" | "auto")`` chooses one explicitly. Importing
this package is cheap: the native engine loads on ``LLMDataDist.init``. See README.md here.
"""

from hixl_connector.datadist.backend import (
    BACKENDS,
    Backend,
    BackendUnavailableError,
    load_backend,
)
from hixl_connector.datadist.cache_manager import CacheManager
from hixl_connector.datadist.cluster_info import LLMClusterInfo, LLMRole
from hixl_connector.datadist.config import LLMConfig, LlmConfig
from hixl_connector.datadist.llm_types import (
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
from hixl_connector.datadist.native import LLMDataDist
from hixl_connector.datadist.profile import BlocksCacheManager, DataDist
from hixl_connector.datadist.pull_handle import PullHandle, ThreadPullHandle
from hixl_connector.datadist.status import LLMException, LLMStatusCode, Status
from hixl_connector.datadist.transfer_async import (
    CacheTask,
    LayerSynchronizer,
    TransferConfig,
    TransferWithCacheKeyConfig,
)

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
