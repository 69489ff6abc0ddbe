"""Opens the LLM-DataDist engine for a worker and registers its KV caches, once.

The only place that knows how a back-end wants to be configured; the worker afterwards
uses nothing but the datadist API (`link_clusters`, `pull_blocks`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hixl_connector.config import HixlConfig
from hixl_connector.datadist import load_backend
from hixl_connector.kv_layout import KVLayout

# Every rank registers one blocks cache holding all layers' tensors (K,V,... order).
BLOCKS_MODEL_ID = 0


@dataclass(frozen=True)
class Engine:
    api: Any  # the back-end module: LLMDataDist, BlocksCacheKey, LLMStatusCode, ...
    datadist: Any
    cache: Any  # the registered blocks cache, destination of D's pulls
    listen_port: int  # where peers link to (P); the configured port when not listening


def open_engine(
    config: HixlConfig, layout: KVLayout, cluster_id: int, producer: bool, consumer: bool
) -> Engine:
    api = load_backend(config.backend)
    role = {(True, False): api.LLMRole.PROMPT, (False, True): api.LLMRole.DECODER}.get(
        (producer, consumer), api.LLMRole.MIX
    )
    datadist = api.LLMDataDist(role, cluster_id)
    llm_config = api.LLMConfig()
    llm_config.device_id = 0
    llm_config.enable_cache_manager = True
    llm_config.enable_remote_cache_accessible = True
    llm_config.sync_kv_timeout = int(config.pull_timeout_s * 1000)
    if producer:
        llm_config.listen_ip_info = f"{config.engine_host}:{config.engine_port}"
    datadist.init(llm_config.generate_options())
    try:
        desc = api.CacheDesc(
            layout.num_tensors,
            [layout.num_blocks, layout.block_bytes],
            api.DataType.DT_UINT8,  # block bytes are opaque to the engine
            api.Placement.HOST,
        )
        # Remote-accessible on both sides: P is read by D, and LLM-DataDist requires it of
        # D's destination cache too when enable_remote_cache_accessible is on.
        cache = datadist.cache_manager.register_blocks_cache(
            desc,
            list(layout.tensor_addrs),
            api.BlocksCacheKey(cluster_id, BLOCKS_MODEL_ID),
            remote_accessible=True,
        )
    except Exception:
        datadist.finalize()
        raise
    bound = getattr(datadist, "listen_port", None)
    return Engine(api, datadist, cache, int(bound) if bound else config.engine_port)
