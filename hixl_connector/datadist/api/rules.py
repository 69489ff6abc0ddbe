"""CANN's argument rules of the four transfer calls, as one table (``RULES``).

Each row is one rule of the reference: table 6.3 for ``pull_blocks`` (its row numbers), section
6.5 for ``push_blocks``, ``pull_cache`` and ``push_cache``. A row names the calls it applies
to; a call's checks are its rows in table order, which is the order CANN applies them, so the
first failing row is the error a caller meets. Pure: no engine, no I/O.

Where CANN accepts a mistake without a word (an unknown keyword, an empty layer range), or
finds it only after linking (unequal block lists), a row refuses it at the call and is marked
``ascend``: the Ascend back-end checks those rows before it hands a call to CANN; the native
engine checks every row. ``README.md`` here lists each difference from CANN.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hixl_connector.datadist.api.c_types import (
    INT64_MAX,
    UINT64_MAX,
    check_int64,
    check_isinstance,
    check_uint32,
    is_valid_id,
)
from hixl_connector.datadist.api.llm_types import (
    BlocksCacheKey,
    Cache,
    CacheKey,
    CacheKeyByIdAndIndex,
)
from hixl_connector.datadist.api.status import (
    LLMException,
    LLMStatusCode,
    raise_if_false,
    raise_if_true,
)

DEFAULT_TENSOR_NUM_PER_LAYER = 2
LAYER_KWARGS = ("src_layer_range", "dst_layer_range", "tensor_num_per_layer")
WRITE_GRANT_KWARG = "hixl_write_grant"  # push_blocks' extension: not in CANN's API


@dataclass(frozen=True)
class Call:
    """What differs between the transfer calls: the names of the peer's key and of the local
    cache, the key types taken, the kind of local cache, the direction and the keywords."""

    name: str
    key_arg: str
    cache_arg: str
    key_types: tuple[type, ...]
    blocks: bool  # the local cache is a blocks cache, else a contiguous one
    push: bool
    kwargs: tuple[str, ...]  # what its ``**kwargs`` takes
    # Named parameters the rules read from ``Transfer.kwargs`` too (a push's layer ranges).
    named: tuple[str, ...] = ()

    @property
    def local_side(self) -> str:
        """A push reads the local cache (its ``src_*`` arguments), a pull writes it."""
        return "src" if self.push else "dst"

    @property
    def remote_side(self) -> str:
        return "dst" if self.push else "src"


ALL_KEYS = (CacheKey, CacheKeyByIdAndIndex, BlocksCacheKey)
PULL_BLOCKS = Call(
    "pull_blocks",
    "src_cache_key",
    "dst_cache",
    ALL_KEYS,
    blocks=True,
    push=False,
    kwargs=LAYER_KWARGS,
)
PUSH_BLOCKS = Call(
    "push_blocks",
    "dst_cache_key",
    "src_cache",
    (BlocksCacheKey,),
    blocks=True,
    push=True,
    kwargs=(WRITE_GRANT_KWARG,),
    named=LAYER_KWARGS,
)
PULL_CACHE = Call(
    "pull_cache",
    "cache_key",
    "cache",
    (CacheKey, CacheKeyByIdAndIndex),
    blocks=False,
    push=False,
    kwargs=LAYER_KWARGS,
)
PUSH_CACHE = Call(
    "push_cache",
    "dst_cache_key",
    "src_cache",
    (CacheKeyByIdAndIndex,),
    blocks=False,
    push=True,
    kwargs=(),
    named=LAYER_KWARGS,
)


@dataclass(frozen=True)
class Transfer:
    """One transfer call's arguments as given, before any check, with what the rules need
    to know of the engine: its live caches by id, whether remote cache access is on, and its
    own cluster id. Layer ranges and ``tensor_num_per_layer`` are read from ``kwargs``, where
    a pull takes them; the pushes put their named parameters there."""

    call: Call
    key: Any
    cache: Any
    src_blocks: Any = ()
    dst_blocks: Any = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    batch_index: Any = 0
    size: Any = -1
    registered: Mapping[int, Cache] = field(default_factory=dict)
    remote_cache_accessible: bool = False
    own_cluster_id: int | None = None

    @property
    def tensor_num_per_layer(self) -> Any:
        return self.kwargs.get("tensor_num_per_layer", DEFAULT_TENSOR_NUM_PER_LAYER)

    def layer_range(self, name: str) -> Any:
        return self.kwargs.get(name)

    @property
    def blocks_key(self) -> bool:
        # Also by name, so that CANN's own BlocksCacheKey counts where the Ascend back-end
        # checks.
        return isinstance(self.key, BlocksCacheKey) or type(self.key).__name__ == "BlocksCacheKey"

    def blocks(self, side: str) -> Any:
        return self.src_blocks if side == "src" else self.dst_blocks


Check = Callable[[Transfer], None]


@dataclass(frozen=True)
class Rule:
    """One row: where the reference states it, the calls it applies to, the check, and
    whether the Ascend back-end checks it ahead of CANN."""

    source: str
    calls: tuple[Call, ...]
    check: Check
    ascend: bool = False


# --- the checks, one per row ------------------------------------------------------------------


def _remote_access_on(t: Transfer) -> None:
    raise_if_false(
        t.remote_cache_accessible,
        f"{t.call.name} needs enable_remote_cache_accessible (llm.EnableRemoteCacheAccessible)",
    )


def _known_kwargs(t: Transfer) -> None:
    unknown = sorted(set(t.kwargs) - set(t.call.kwargs) - set(t.call.named))
    if unknown:
        raise TypeError(
            f"{t.call.name}() got unexpected keyword argument(s) {unknown}; "
            f"allowed keyword arguments are {list(t.call.kwargs)}"
        )


def _write_grant(t: Transfer) -> None:
    grant = t.kwargs.get(WRITE_GRANT_KWARG, 0)
    if isinstance(grant, bool) or not isinstance(grant, int):
        raise TypeError(f"{WRITE_GRANT_KWARG} only support ['int'], but got {type(grant)}.")
    raise_if_false(
        0 <= grant <= INT64_MAX, f"{WRITE_GRANT_KWARG} {grant} is out of range [0, 2**63)"
    )


def _key_type(t: Transfer) -> None:
    key_types = t.call.key_types
    if t.call is PULL_CACHE and t.remote_cache_accessible:
        key_types = (CacheKeyByIdAndIndex,)  # a peer's rows are reachable only by cache id
    check_isinstance(t.call.key_arg, t.key, key_types, allow_none=False)


def _cache_type(t: Transfer) -> None:
    check_isinstance(t.call.cache_arg, t.cache, Cache, allow_none=False)


def _block_lists(t: Transfer) -> None:
    for name, blocks in (("src_blocks", t.src_blocks), ("dst_blocks", t.dst_blocks)):
        if blocks is None:
            raise TypeError(f"{name} must be a list or tuple of int, but got None.")
        check_isinstance(name, blocks, (list, tuple), int)


def _batch_index_type(t: Transfer) -> None:
    check_uint32("src_batch_index" if t.call.push else "batch_index", t.batch_index)


def _size_type(t: Transfer) -> None:
    check_int64("size", t.size)


def _cache_kind(t: Transfer) -> None:
    if t.call.blocks:
        raise_if_false(
            t.cache.is_blocks_cache,
            f"param check failed, {t.call.cache_arg} should be blocks cache.",
        )
    else:
        raise_if_true(
            t.cache.is_blocks_cache,
            f"param check failed, {t.call.cache_arg} can not be blocks cache.",
        )


def _size_value(t: Transfer) -> None:
    if t.call.push:
        raise_if_false(t.size == -1, f"size ({t.size}) must be -1: a push moves the whole row")
    else:
        raise_if_false(
            t.size == -1 or t.size > 0,
            f"[{t.call.name}] param check failed, size ({t.size}) is invalid",
        )


def _dst_blocks_not_empty(t: Transfer) -> None:
    raise_if_false(len(t.dst_blocks) > 0, "dst_blocks can not be empty.")


def _tensor_num_per_layer(t: Transfer) -> None:
    n = t.tensor_num_per_layer
    check_uint32("tensor_num_per_layer", n)
    raise_if_false(
        n > 0,
        f"[{t.call.name}] param check failed, tensor_num_per_layer ({n}) is invalid, "
        f"should [1, {t.cache.cache_desc.num_tensors}]",
    )


def _blocks_match_key(t: Transfer) -> None:
    if isinstance(t.key, CacheKey):
        req_valid, prefix_valid = is_valid_id(t.key.req_id), is_valid_id(t.key.prefix_id)
        ids = f"req id:{t.key.req_id}, prefix id:{t.key.prefix_id}."
        raise_if_true(
            not req_valid and not prefix_valid,
            f"one of req id and prefix id should contain valid value:[0, 2**64-1), {ids}",
        )
        raise_if_true(
            req_valid and prefix_valid,
            f"only one of req id and prefix id should contain valid value:[0, 2**64-1), {ids}",
        )
    if not t.call.blocks:
        return
    if t.blocks_key:
        raise_if_false(len(t.src_blocks) > 0, "src_blocks can not be empty.")
    else:
        raise_if_false(
            len(t.src_blocks) == 0,
            "src_blocks should be empty when src_cache_key is not instance of BlocksCacheKey.",
        )


def _given_ranges(t: Transfer) -> list[tuple[str, Any]]:
    names = ("src_layer_range", "dst_layer_range")
    return [(name, t.layer_range(name)) for name in names if t.layer_range(name) is not None]


def _range_types(t: Transfer) -> None:
    for name, layers in _given_ranges(t):
        check_isinstance(name, layers, range)


def _range_steps(t: Transfer) -> None:
    for name, layers in _given_ranges(t):
        raise_if_true(layers.step != 1, f"param check failed, {name} step must be 1.")


def _ranges_not_empty(t: Transfer) -> None:
    for name, layers in _given_ranges(t):
        raise_if_true(
            isinstance(layers, range) and len(layers) == 0,
            f"{name} {layers} is empty or reversed; pass None to transfer all layers",
        )


def _range_bounds(t: Transfer) -> None:
    for name, layers in _given_ranges(t):
        raise_if_true(layers.start < 0, f"{name} is invalid, the start value:{layers.start} is < 0")
        check_uint32(name, layers.start)
        check_uint32(name, layers[-1])


def _push_layer_counts(t: Transfer) -> None:
    src_layers, dst_layers = push_layers(t)
    raise_if_false(
        len(src_layers) > 0,
        f"{t.call.name} moves no layer: tensor_num_per_layer {t.tensor_num_per_layer} is more "
        f"than the {t.cache.cache_desc.num_tensors} tensors of cache {t.cache.cache_id}",
    )
    raise_if_false(
        len(src_layers) == len(dst_layers),
        f"src_layer_range {src_layers} and dst_layer_range {dst_layers} differ in length",
    )


def _block_ids(t: Transfer) -> None:
    # The CANN binding converts ids to uint64 and raises TypeError when it cannot.
    for name, blocks in (("src_blocks", t.src_blocks), ("dst_blocks", t.dst_blocks)):
        if blocks and (min(blocks) < 0 or max(blocks) > UINT64_MAX):
            raise TypeError(f"{name} ids must fit uint64, got range [{min(blocks)}, {max(blocks)}]")


def _not_own_cluster(t: Transfer) -> None:
    raise_if_true(t.key.cluster_id == t.own_cluster_id, "data can not be pulled from own cluster")


def _registered(t: Transfer) -> None:
    raise_if_false(
        t.registered.get(t.cache.cache_id) is t.cache,
        f"local cache {t.cache.cache_id} does not exist (unregistered or from another engine)",
        status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
    )


def _local_remote_accessible(t: Transfer) -> None:
    raise_if_true(
        t.remote_cache_accessible and not t.cache._remote_accessible,
        f"local cache {t.cache.cache_id} is not remote accessible; register it with "
        "remote_accessible=True when enable_remote_cache_accessible is on",
    )


def _batch_index_in_cache(t: Transfer) -> None:
    batch_size = t.cache.cache_desc.batch_size
    raise_if_false(
        t.batch_index < batch_size,
        f"src_batch_index {t.batch_index} is outside batch size {batch_size} of cache "
        f"{t.cache.cache_id}",
    )


def _remote_block_ids(t: Transfer) -> None:
    highest = max(t.blocks(t.call.remote_side), default=0)
    raise_if_true(
        highest > INT64_MAX,
        f"{t.call.remote_side} block id {highest} is out of range of any cache",
    )


def _local_block_ids(t: Transfer) -> None:
    num_blocks = t.cache.cache_desc.batch_size
    bad = [b for b in t.blocks(t.call.local_side) if b >= num_blocks]
    raise_if_true(
        bool(bad),
        f"{t.call.local_side} block id {bad[0] if bad else 0} out of range [0, {num_blocks}) "
        f"of cache {t.cache.cache_id}",
    )


def _equal_lengths(t: Transfer) -> None:
    src, dst = t.src_blocks, t.dst_blocks
    # Where the Ascend back-end checks, this row runs before any type check: lists only.
    lists = isinstance(src, (list, tuple)) and isinstance(dst, (list, tuple))
    if t.blocks_key and lists and len(src) != len(dst):
        raise LLMException(
            f"{t.call.name}: src_blocks size {len(src)} != dst_blocks size {len(dst)}",
            status_code=LLMStatusCode.LLM_PARAM_INVALID,
        )


def _layers_divide_tensors(t: Transfer) -> None:
    if not _given_ranges(t):
        return  # without a range, tensor_num_per_layer need only be >= 1 (table 6.4)
    n, num_tensors = t.tensor_num_per_layer, t.cache.cache_desc.num_tensors
    raise_if_false(
        num_tensors % n == 0,
        f"tensor_num_per_layer ({n}) must divide the number of tensors of cache "
        f"{t.cache.cache_id} ({num_tensors})",
    )


def _local_layers_fit(t: Transfer) -> None:
    name = f"{t.call.local_side}_layer_range"
    layers = t.layer_range(name)
    if layers is None:
        return  # every layer
    n, num_tensors = t.tensor_num_per_layer, t.cache.cache_desc.num_tensors
    raise_if_true(
        (layers.start + len(layers)) * n > num_tensors,
        f"{name} {layers} with tensor_num_per_layer {n} is out of range of "
        f"cache {t.cache.cache_id} ({num_tensors} tensors)",
    )


# --- the table --------------------------------------------------------------------------------

ALL = (PULL_BLOCKS, PUSH_BLOCKS, PULL_CACHE, PUSH_CACHE)
BLOCK_CALLS = (PULL_BLOCKS, PUSH_BLOCKS)
ROW_CALLS = (PULL_CACHE, PUSH_CACHE)
PUSHES = (PUSH_BLOCKS, PUSH_CACHE)
PULLS = (PULL_BLOCKS, PULL_CACHE)
LOCAL_LAYER_CALLS = (PULL_BLOCKS, PUSH_BLOCKS, PUSH_CACHE)  # pull_cache: the engine checks

RULES: tuple[Rule, ...] = (
    Rule("6.5: a push needs remote cache access", PUSHES, _remote_access_on),
    Rule("6.3 #2: keywords the call takes", ALL, _known_kwargs, ascend=True),
    Rule("extension: hixl_write_grant is an id or 0", (PUSH_BLOCKS,), _write_grant),
    Rule("6.3 #3: the key's type", ALL, _key_type),
    Rule("6.3 #4: the local cache is a Cache", ALL, _cache_type),
    Rule("6.3 #5-6: lists or tuples of int", BLOCK_CALLS, _block_lists),
    Rule("6.5: the batch index is uint32", ROW_CALLS, _batch_index_type),
    Rule("6.5: size is int64", ROW_CALLS, _size_type),
    Rule("6.3 #7: a blocks cache, or a contiguous one", ALL, _cache_kind),
    Rule("6.5: size is -1 or, for a pull, > 0", ROW_CALLS, _size_value),
    Rule("6.3 #8: dst_blocks is not empty", BLOCK_CALLS, _dst_blocks_not_empty),
    Rule("6.3 #9-10: tensor_num_per_layer", ALL, _tensor_num_per_layer),
    Rule("6.3 #11: the key's ids, src_blocks by key", ALL, _blocks_match_key),
    Rule("6.3 #12: layer ranges are ranges", ALL, _range_types),
    Rule("6.3 #13: layer ranges step by 1", ALL, _range_steps),
    Rule("6.3 #15: no empty or reversed range", ALL, _ranges_not_empty, ascend=True),
    Rule("6.3 #14-15: range starts >= 0, uint32", ALL, _range_bounds),
    Rule("6.5: a push's ranges hold as many layers", PUSHES, _push_layer_counts),
    Rule("6.3 #16: block ids fit uint64", BLOCK_CALLS, _block_ids),
    Rule("6.5: not from its own cluster", (PULL_CACHE,), _not_own_cluster),
    Rule("6.3 #17: the local cache is registered", ALL, _registered),
    Rule("6.3 #25: the local cache is accessible", PULLS, _local_remote_accessible),
    Rule("6.5: the source row is in the cache", (PUSH_CACHE,), _batch_index_in_cache),
    Rule("6.3 #27: the peer's block ids fit int64", BLOCK_CALLS, _remote_block_ids),
    Rule("6.3 #18: local block ids in the cache", BLOCK_CALLS, _local_block_ids),
    Rule("6.3 #21: block lists as long", BLOCK_CALLS, _equal_lengths, ascend=True),
    Rule("6.3 #18: N divides the tensors", (PULL_BLOCKS,), _layers_divide_tensors),
    Rule("6.3 #18: local layers in the cache", LOCAL_LAYER_CALLS, _local_layers_fit),
)


def check(transfer: Transfer, ascend_only: bool = False) -> Transfer:
    """Applies the call's rows in table order (only the ``ascend`` ones if asked); the first
    failing row raises. Returns ``transfer`` for the caller to convert."""
    for rule in RULES:
        if transfer.call in rule.calls and (rule.ascend or not ascend_only):
            rule.check(transfer)
    return transfer


# --- what a checked transfer moves ------------------------------------------------------------


def layer_tensors(layer_range: range | None, tensor_num_per_layer: int) -> tuple[int, int]:
    """Layer ``l`` is tensors ``[l*N, (l+1)*N)``: (first tensor, count); count -1 = all."""
    if layer_range is None:
        return 0, -1
    return layer_range.start * tensor_num_per_layer, len(layer_range) * tensor_num_per_layer


def push_layers(t: Transfer) -> tuple[range, range]:
    """A push's source and destination layers: every layer of the source where a range is
    None."""
    every_layer = range(t.cache.cache_desc.num_tensors // t.tensor_num_per_layer)
    src, dst = t.layer_range("src_layer_range"), t.layer_range("dst_layer_range")
    return (every_layer if src is None else src), (every_layer if dst is None else dst)
