"""A worker's KV caches registered with its LLM-DataDist engine, once (``register_kv``),
and the reads D makes of peers' caches through them (``RegisteredKV``).

The only place that knows how a back-end wants to be configured: it reads the back-end's
``BackendProfile`` (placement, LLMConfig fields, device id, alignment, request-size limit).
The worker afterwards uses nothing but the datadist API, through ``RegisteredKV.submit``.

Rules of LLM-DataDist this module keeps (reference section 8): one LLMDataDist per process
(one per worker process); every cache registered before the first link (all of them
here, before ``register_kv`` returns); one model_id per registered cache under the cluster id.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from hixl_connector.connector.config import HixlConfig
from hixl_connector.connector.endpoints import RankAddress
from hixl_connector.connector.kv.layout import KVLayout
from hixl_connector.connector.kv.word_memory import WordMemory
from hixl_connector.connector.leases.guarded_read import (
    SCRATCH_WORDS,
    WORD_BYTES,
    GuardedReads,
)
from hixl_connector.connector.mapping.blocks import chunk_pairs
from hixl_connector.datadist import (
    Backend,
    BlocksPull,
    DataDist,
    PullHandle,
    ThreadPullHandle,
    load_backend,
)

# Model id of the first (for MHA/GQA the only) registered blocks cache; MLA's other parts
# follow as BLOCKS_MODEL_ID + 1, + 2, ...
BLOCKS_MODEL_ID = 0
# The same memory registered again in slices (block_slices), for peers of another block size.
SLICES_MODEL_ID = 1024
# A hybrid state model's state pages, registered again in units of whole states (state_layout).
STATE_MODEL_ID = 1536
# P's lease words, and the scratch words D reads them into (leases.guarded_read).
LEASE_WORDS_MODEL_ID = 2048
SCRATCH_WORDS_MODEL_ID = 2049
# Push mode, D: one word per request being pushed and P rank writing it, which that rank
# writes after its blocks; a request holds a block at least, and P ranks of a TP size up to
# PUSH_WORDS_PER_BLOCK times D's write a block each.
PUSH_WORDS_MODEL_ID = 2050
PUSH_WORDS_PER_BLOCK = 4
ONE_TENSOR = {"tensor_num_per_layer": 1}


@dataclass(frozen=True)
class Registration:
    """Tensors registered as one blocks cache under one model_id."""

    model_id: int
    addrs: tuple[int, ...]
    unit_bytes: int  # the registered "block": a KV head of a block, a slice, or a whole block
    tensors_per_layer: int
    units: int  # registered "blocks" per tensor


@dataclass(frozen=True)
class RegisteredCache:
    model_id: int
    cache: Any
    tensors_per_layer: int
    units_per_block: int = 1  # registered "blocks" per KV block (KV heads where they split)


@dataclass(frozen=True)
class RegisteredKV:
    api: Backend  # LLMDataDist, BlocksCacheKey, LLMStatusCode, PROFILE, ...
    datadist: DataDist
    caches: tuple[RegisteredCache, ...]  # destinations of D's pulls, one per model_id
    listen_port: int  # where peers link to; the configured port when not listening
    max_pairs_per_pull: int | None  # chunk size of long block lists; None: no limit
    slices: RegisteredCache | None = None  # the caches again in slices, where registered
    # Words, each in the KV's memory kind and registered as the KV is (leases.guarded_read):
    scratch: RegisteredCache | None = None  # D: where peers' lease words are read to
    scratch_words: WordMemory | None = None  # ... and the words themselves
    lease_words: RegisteredCache | None = None  # P: its lease words (a push's last write)
    lease_word_memory: WordMemory | None = None  # ... and the words themselves
    push_words: RegisteredCache | None = None  # D, push mode: where P's last writes land
    push_word_memory: WordMemory | None = None  # ... and the words themselves
    # The states in units (state_layout), where a model has any; on vllm-ascend's planes, the
    # KV beside them too.
    state: RegisteredCache | None = None

    def guarded_reads(self) -> GuardedReads[BlocksPull]:
        """This decode engine's guarded reads (leases.guarded_read): its scratch rows, each
        read's word-blocks-word batch of this engine's pulls, and their verdicts."""
        if self.scratch is None or self.scratch_words is None:
            raise ValueError("this engine registered no scratch words: it does not decode")
        scratch = self.scratch.cache

        def word_pull(remote_cluster_id: int, slot: int, index: int) -> BlocksPull:
            key = self.api.BlocksCacheKey(remote_cluster_id, LEASE_WORDS_MODEL_ID)
            return BlocksPull(key, scratch, [slot], [index], ONE_TENSOR)

        return GuardedReads(self.scratch_words, word_pull)

    def block_pulls(
        self, reads: Sequence[tuple[int, Sequence[int], Sequence[int]]], sliced: bool
    ) -> list[BlocksPull]:
        """This engine's pulls of ``reads``: for each ``(remote_cluster_id, src, dst)``, unit
        ``src[i]`` of that peer into unit ``dst[i]`` here, for every registered cache (a unit:
        one KV head of a block where heads split, else a whole block; with ``sliced``, a
        slice of one). Each pull stays under the back-end's request-size limit."""
        if sliced and self.slices is None:
            raise ValueError("this engine registered no slices of its KV caches")
        targets = (self.slices,) if sliced and self.slices is not None else self.caches
        return self._pulls(targets, reads)

    def state_pulls(
        self, reads: Sequence[tuple[int, Sequence[int], Sequence[int]]]
    ) -> list[BlocksPull]:
        """This engine's pulls of the state units of ``reads`` (state_layout), as
        ``block_pulls`` does for blocks."""
        if self.state is None:
            raise ValueError("this engine registered no state: its model has none")
        return self._pulls((self.state,), reads)

    def _pulls(
        self,
        targets: Sequence[RegisteredCache],
        reads: Sequence[tuple[int, Sequence[int], Sequence[int]]],
    ) -> list[BlocksPull]:
        blocks = []
        for remote_cluster_id, src, dst in reads:
            chunks = (
                chunk_pairs(src, dst, self.max_pairs_per_pull)
                if self.max_pairs_per_pull is not None
                else [(tuple(src), tuple(dst))]
            )
            for part in targets:
                key = self.api.BlocksCacheKey(remote_cluster_id, part.model_id)
                kwargs = {"tensor_num_per_layer": part.tensors_per_layer}
                blocks += [BlocksPull(key, part.cache, list(s), list(d), kwargs) for s, d in chunks]
        return blocks

    def submit(self, pulls: Sequence[BlocksPull]) -> PullHandle | ThreadPullHandle:
        """The pulls in order, as one job of the engine's: the handle's ``poll``/``wait`` raise
        the first failure (LLMException), and its ``finished_at`` is when the last byte landed.
        Bad arguments raise here."""
        return self.api.pull_blocks_batch_async(self.datadist.cache_manager, pulls)

    def grant(self, writer_cluster_id: int, cache: RegisteredCache, units: Sequence[int]) -> int:
        """Lets that peer push into ``units`` of ``cache`` (write_grants); the grant id."""
        return int(self.datadist.cache_manager.grant_writes(cache.cache, writer_cluster_id, units))

    def revoke(self, grant: int, timeout_s: float) -> None:
        """Once this returns, nothing lands under ``grant``; raises LLMException(LLM_TIMEOUT)
        while a write under it is still in flight after ``timeout_s``."""
        self.datadist.cache_manager.revoke_writes(grant, max(1, int(timeout_s * 1000)))

    def writes_landed(self) -> int:
        """How many peers' writes have landed here so far."""
        return self.datadist.cache_manager.writes_landed()

    def wait_for_writes(self, seen: int, timeout_s: float) -> int:
        """Sleeps until a peer's write lands (``writes_landed()`` differs from ``seen``) or
        ``timeout_s`` passed; returns ``writes_landed()``."""
        timeout_ms = max(1, math.ceil(timeout_s * 1000))
        return self.datadist.cache_manager.wait_for_writes(seen, timeout_ms)

    def push(
        self,
        remote_cluster_id: int,
        part: RegisteredCache,
        dst_model_id: int,
        pairs: tuple[Sequence[int], Sequence[int]],
        grant: int,
        layers: range | None = None,
    ) -> None:
        """Writes units ``pairs[0]`` of ``part`` into units ``pairs[1]`` of that peer's cache
        ``dst_model_id``, under the peer's ``grant``, ``layers`` of them (None: all);
        returns once they landed."""
        src, dst = pairs
        self.datadist.cache_manager.push_blocks(
            self.api.BlocksCacheKey(remote_cluster_id, dst_model_id),
            part.cache,
            list(src),
            list(dst),
            src_layer_range=layers,
            dst_layer_range=layers,
            tensor_num_per_layer=part.tensors_per_layer,
            hixl_write_grant=grant,
        )

    def reads_in_place(self, remote_cluster_id: int) -> bool:
        """Whether reads from this linked peer are one-sided copies out of this host's
        memory, which end whatever the peer does (the back-end's profile says)."""
        return self.api.PROFILE.reads_in_place(self.datadist, remote_cluster_id)

    def describe_link(self, remote_cluster_id: int) -> str:
        """The fabric the link to that peer uses, in words (the back-end's profile says)."""
        return self.api.PROFILE.describe_link(self.datadist, remote_cluster_id)

    def placements(self) -> dict[str, str]:
        """The memory each registered cache is in ("DEVICE" or "HOST"), by what it holds."""
        named = [(f"kv model_id {c.model_id}", c) for c in self.caches]
        named += [
            (what, cache)
            for what, cache in (
                ("kv slices", self.slices),
                ("lease words", self.lease_words),
                ("scratch rows", self.scratch),
                ("push words", self.push_words),
                ("state", self.state),
            )
            if cache is not None
        ]
        return {what: _placement_name(cache.cache) for what, cache in named}


def registrations(layout: KVLayout) -> list[Registration]:
    """MHA/GQA: one blocks cache of all tensors in K0,V0,K1,V1,... order. Layers of unlike
    parts (MLA: latent and rope) register one cache per part, each under its own model_id."""
    if not layout.part_block_bytes:
        return [
            Registration(
                BLOCKS_MODEL_ID,
                layout.tensor_addrs,
                layout.unit_bytes,
                layout.tensors_per_layer,
                layout.num_blocks * layout.units_per_block,
            )
        ]
    per_layer = len(layout.part_block_bytes)
    return [
        Registration(
            BLOCKS_MODEL_ID + part,
            layout.tensor_addrs[part::per_layer],
            nbytes,
            1,
            layout.num_blocks,
        )
        for part, nbytes in enumerate(layout.part_block_bytes)
    ]


def _kv_device(layout: KVLayout) -> Any:
    return layout.views[0].device if layout.views else None


def _configure(api: Backend, config: HixlConfig, layout: KVLayout) -> Any:
    profile = api.PROFILE
    llm_config = api.LLMConfig()
    device = _kv_device(layout)
    llm_config.device_id = profile.device_id_of(layout.views[0]) if device is not None else 0
    llm_config.enable_cache_manager = True
    # Remote-accessible on both sides: P is read by D, and LLM-DataDist requires it of D's
    # destination cache too. The hixl transfer back-end needs it anyway.
    llm_config.enable_remote_cache_accessible = True
    llm_config.sync_kv_timeout = int(config.pull_timeout_s * 1000)
    if profile.transfer_backend:
        llm_config.transfer_backend = profile.transfer_backend
    if profile.name == "ascend" and config.ascend_local_comm_res:
        llm_config.local_comm_res = config.ascend_local_comm_res
    if profile.native_options:
        llm_config.hixl_transport = config.transport
        llm_config.hixl_tcp_connections = config.tcp_connections
        llm_config.hixl_transfer_threads = config.transfer_threads
        llm_config.hixl_server_handshakes = config.server_handshakes
        llm_config.hixl_server_connections = config.server_connections
        # Always set, even empty: the connector's config is the one source of the token, so
        # the engine never falls back to HIXL_AUTH_TOKEN behind an explicit "auth_token": "".
        llm_config.hixl_auth_token = config.auth_token
        # Pull mode: D reads, P never reaches back, so D opens no return listener. Push
        # mode: P writes into D over the link D opened, and only where D granted it.
        push = config.pushes
        llm_config.hixl_links_both_ways = push
        llm_config.hixl_writes_by_grant = push
    return llm_config


def register_kv(
    config: HixlConfig,
    layout: KVLayout,
    rank: RankAddress,
    producer: bool,
    consumer: bool,
) -> RegisteredKV:
    """``rank``: this rank's cluster id and engine port (one listener per rank). A producer
    gets lease words (one slot per block: a lease holds a block at least), a consumer scratch
    rows (and in push mode push words), all beside the KV on its device."""
    cluster_id, port = rank.cluster_id, rank.engine_port
    device = _kv_device(layout)
    api = load_backend(config.backend, getattr(device, "type", None))
    profile = api.PROFILE
    if config.pushes and layout.kv_in_states_buffers:
        raise ValueError(
            "kv_connector_extra_config 'transfer_mode': 'push' writes KV blocks registered "
            "on their own, and this KV lies in planes beside a hybrid model's states "
            "(vllm-ascend): use 'transfer_mode': 'pull'"
        )
    if config.pushes and not profile.native_options:
        raise ValueError(
            f"kv_connector_extra_config 'transfer_mode': 'push' needs the native engine's "
            f"write grants, which the {profile.name!r} back-end lacks: use 'transfer_mode': "
            "'pull'"
        )
    on_device = device is not None and profile.registers_as_device(device)
    placement = api.Placement.DEVICE if on_device else api.Placement.HOST
    # On vllm-ascend's planes the KV is read through the states' registration, which starts at
    # each buffer's (aligned) first byte where K and V do not.
    kv_parts = [] if layout.kv_in_states_buffers else registrations(layout)
    if on_device and config.ascend_hccs:
        for part in kv_parts:
            profile.check_device_alignment(list(part.addrs), f"cache model_id {part.model_id}")
        if layout.state is not None:
            profile.check_device_alignment(
                list(layout.state.regions), f"cache model_id {STATE_MODEL_ID} (the states)"
            )
    role = {(True, False): api.LLMRole.PROMPT, (False, True): api.LLMRole.DECODER}.get(
        (producer, consumer), api.LLMRole.MIX
    )
    llm_config = _configure(api, config, layout)
    # The hixl transfer back-end listens on both sides; the native engine only where served.
    if producer or profile.transfer_backend:
        if port == 0 and not profile.native_options:
            # Only the native engine binds any free port and reports it for the handshake.
            raise ValueError(
                f"kv_connector_extra_config 'engine_port' must be set (> 0) for the "
                f"{profile.name!r} back-end: peers link to that port"
            )
        llm_config.listen_ip_info = f"{config.engine_host}:{port}"
    datadist = api.LLMDataDist(role, cluster_id)
    datadist.init(llm_config.generate_options())
    # The words live where the KV lives, registered with its placement (one memory kind).
    word_device = device if device is not None else "cpu"
    lease_word_memory = WordMemory(layout.num_blocks, word_device) if producer else None
    scratch_words = WordMemory(SCRATCH_WORDS, word_device) if consumer else None
    pushed = consumer and config.pushes
    push_word_count = layout.num_blocks * PUSH_WORDS_PER_BLOCK
    push_word_memory = WordMemory(push_word_count, word_device) if pushed else None
    try:
        caches = tuple(
            replace(
                _register(api, datadist, cluster_id, p, placement),
                units_per_block=p.units // layout.num_blocks,
            )
            for p in kv_parts
        )
        state = None
        if layout.state is not None:
            regions, units = layout.state.regions, layout.state.region_units
            registration = Registration(STATE_MODEL_ID, regions, layout.state.unit_bytes, 1, units)
            state = _register(api, datadist, cluster_id, registration, placement)
        slices = None
        if layout.slice_bytes:
            registration = Registration(
                SLICES_MODEL_ID,
                layout.tensor_addrs,
                layout.slice_bytes,
                layout.tensors_per_layer,
                layout.num_blocks * layout.block_bytes // layout.slice_bytes,
            )
            slices = replace(
                _register(api, datadist, cluster_id, registration, placement),
                units_per_block=layout.block_bytes // layout.slice_bytes,
            )

        def register_words(model_id: int, memory: WordMemory | None) -> RegisteredCache | None:
            if memory is None:
                return None
            registration = Registration(model_id, (memory.address,), WORD_BYTES, 1, len(memory))
            return _register(api, datadist, cluster_id, registration, placement)

        words = register_words(LEASE_WORDS_MODEL_ID, lease_word_memory)
        push_words = register_words(PUSH_WORDS_MODEL_ID, push_word_memory)
        scratch = register_words(SCRATCH_WORDS_MODEL_ID, scratch_words)
    except Exception:
        datadist.finalize()
        raise
    bound = getattr(datadist, "listen_port", None)  # native extension; CANN binds `port`
    bases = [p.addrs for p in kv_parts] + ([layout.state.regions] if layout.state else [])
    limits = [
        profile.max_pairs_per_pull(len(addrs)) for addrs in bases if profile.max_pairs_per_pull
    ]
    return RegisteredKV(
        api,
        datadist,
        caches,
        int(bound) if bound else port,
        min(limits) if limits else None,
        slices,
        scratch,
        scratch_words,
        words,
        lease_word_memory,
        push_words,
        push_word_memory,
        state,
    )


def _placement_name(cache: Any) -> str:
    placement = cache.cache_desc.placement
    return str(getattr(placement, "name", placement))


def _register(
    api: Backend, datadist: DataDist, cluster_id: int, registration: Registration, placement: Any
) -> RegisteredCache:
    desc = api.CacheDesc(
        len(registration.addrs),
        [registration.units, registration.unit_bytes],
        api.DataType.DT_UINT8,  # block bytes are opaque to the engine
        placement,
    )
    cache = datadist.cache_manager.register_blocks_cache(
        desc,
        list(registration.addrs),
        api.BlocksCacheKey(cluster_id, registration.model_id),
        remote_accessible=True,
    )
    return RegisteredCache(registration.model_id, cache, registration.tensors_per_layer)
