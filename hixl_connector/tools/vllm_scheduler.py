"""vLLM's own scheduler with the HIXL connector's scheduler half, the worker side left to the
caller: for the per-step benchmark (bench_step) and the tests that drive vLLM's scheduling."""

from __future__ import annotations

from pathlib import Path
from typing import Any

BLOCK_SIZE = 16
MAX_MODEL_LEN = 512


def vllm_config(
    model_dir: Path,
    kv_role: str,
    *,
    engine_id: str,
    num_blocks: int = 64,
    policy: str = "fail",
    extra: dict[str, Any] | None = None,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = MAX_MODEL_LEN,
    async_scheduling: bool = False,
    sliding_window: int = 0,
    state: str = "",
) -> Any:
    """vLLM's config of the tiny model on CPU, ``num_blocks`` blocks of BLOCK_SIZE tokens,
    the HIXL connector in ``kv_role`` configured by ``extra``."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    config = VllmConfig(
        model_config=ModelConfig(
            model=str(model_dir),
            tokenizer=str(model_dir),
            dtype="float32",
            max_model_len=MAX_MODEL_LEN,
            seed=0,
            enforce_eager=True,
        ),
        cache_config=CacheConfig(
            block_size=BLOCK_SIZE,
            enable_prefix_caching=state != "none",
            mamba_cache_mode=state or "none",
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=MAX_MODEL_LEN,
            is_encoder_decoder=False,
            async_scheduling=async_scheduling,
            disable_hybrid_kv_cache_manager=not (sliding_window or state),
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="HixlConnector",
            kv_connector_module_path="hixl_connector.connector.facade",
            kv_role=kv_role,
            engine_id=engine_id,
            kv_load_failure_policy=policy,
            kv_connector_extra_config=dict(extra or {}),
        ),
        device_config=DeviceConfig("cpu"),
    )
    config.cache_config.num_gpu_blocks = num_blocks
    return config


def real_scheduler(
    model_dir: Path,
    kv_role: str,
    *,
    engine_id: str,
    num_blocks: int = 64,
    async_scheduling: bool = False,
    sliding_window: int = 0,
    state: str = "",
    **options: Any,
) -> Any:
    """vLLM's Scheduler (AsyncScheduler with ``async_scheduling``) over ``num_blocks`` blocks
    of BLOCK_SIZE tokens, ``options`` the rest of ``vllm_config``'s; with ``sliding_window``, a
    hybrid model (layer 0 full attention, layer 1 sliding window, a KV-cache group each)
    under vLLM's hybrid KV-cache manager; with ``state`` (a mamba_cache_mode), a hybrid state
    model (layer 0 full attention, layer 1 a Mamba2 state): "none", one slot per request and
    no prefix caching; "align", prefix caching and a state per block of tokens."""
    import torch
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    from hixl_connector.connector.peers.incarnation import IncarnationFile, incarnation_path

    config = vllm_config(
        model_dir,
        kv_role,
        engine_id=engine_id,
        num_blocks=num_blocks,
        async_scheduling=async_scheduling,
        sliding_window=sliding_window,
        state=state,
        **options,
    )
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=2, head_size=16, dtype=torch.float32
    )
    groups = [KVCacheGroupSpec(["layers.0", "layers.1"], spec)]
    if sliding_window:
        window = SlidingWindowSpec(
            block_size=BLOCK_SIZE,
            num_kv_heads=2,
            head_size=16,
            dtype=torch.float32,
            sliding_window=sliding_window,
        )
        groups = [KVCacheGroupSpec(["layers.0"], spec), KVCacheGroupSpec(["layers.1"], window)]
    if state:
        mamba = MambaSpec(
            block_size=MAX_MODEL_LEN if state == "none" else BLOCK_SIZE,
            shapes=((3, 64), (4, 16, 8)),
            dtypes=(torch.float32, torch.float32),
            mamba_cache_mode=state,
        )
        groups = [KVCacheGroupSpec(["layers.0"], spec), KVCacheGroupSpec(["layers.1"], mamba)]
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups
    )
    if hasattr(kv_cache_config, "hash_block_size"):  # 0.34: the engine core resolves it
        kv_cache_config.hash_block_size = BLOCK_SIZE
    if kv_role != "kv_consumer" and not incarnation_path(engine_id, 0, 0).exists():
        # What P's worker does when it registers its KV caches, before vLLM builds the
        # scheduler (which writes its incarnation there, then unlinks the file).
        IncarnationFile.create(incarnation_path(engine_id, 0, 0)).close()
    scheduler_class = AsyncScheduler if async_scheduling else Scheduler
    return scheduler_class(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(config),
        # Scheduling steps in whole blocks of every group (vLLM takes their LCM).
        block_size=MAX_MODEL_LEN if state == "none" else BLOCK_SIZE,
        log_stats=True,
    )


def model_runner_output(req_ids: list[str], **fields: Any) -> Any:
    """vLLM's ModelRunnerOutput for ``req_ids``, with the index map where this vLLM still
    has the field (0.34 dropped ``req_id_to_index``)."""
    import dataclasses

    from vllm.v1.outputs import ModelRunnerOutput

    if "req_id_to_index" in {field.name for field in dataclasses.fields(ModelRunnerOutput)}:
        fields["req_id_to_index"] = {req_id: index for index, req_id in enumerate(req_ids)}
    return ModelRunnerOutput(req_ids=req_ids, **fields)
