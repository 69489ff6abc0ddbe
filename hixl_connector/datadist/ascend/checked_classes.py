"""CANN's ``llm_datadist`` classes with the project's own checks, for the "ascend" back-end.

CANN's Python layer accepts some mistakes without a word, and each would show on Ascend only
as wrong KV, or as a failure far from its cause. The back-end wraps CANN's classes so that each
raises at the call instead, as the native engine does (README.md here, "Differences from
CANN llm_datadist"):

- an ``LLMConfig`` attribute that is not an option: ``AttributeError`` naming the options
  (CANN stores it and never applies it);
- an ``init`` option key outside CANN's ``llm.``/``ge.`` namespaces, once the native engine's
  ``hixl.*`` keys are dropped: ``LLM_PARAM_INVALID`` (CANN forwards any key);
- an ``llm.listenIpInfo`` that is not "<IPv4 address>:<port>": ``LLM_PARAM_INVALID`` (CANN
  fails an IPv6 address at ``init`` and takes only IPv4 literals in ``LLMClusterInfo``);
- a blocks cache with an address count other than ``num_tensors``: ``LLM_PARAM_INVALID``;
- a ``BlocksCacheKey`` registered twice: ``LLM_FAILED`` (CANN re-points it, last wins);
- a registration after ``link_clusters``: ``LLM_PARAM_INVALID`` (CANN accepts it, but the
  memory is not remotely accessible);
- ``pull_blocks``: the rows of the rule table (``api/rules.py``) marked ``ascend``, before
  CANN sees the call. An unknown keyword raises ``TypeError`` (CANN ignores it, so a misspelt
  ``tensor_num_per_layer`` silently becomes 2); an empty or reversed layer range (CANN: all
  layers) or lists of different lengths raise ``LLM_PARAM_INVALID``.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from hixl_connector.datadist.api.config import check_option_name
from hixl_connector.datadist.api.rules import PULL_BLOCKS, Transfer, check
from hixl_connector.datadist.api.status import LLMException

CANN_OPTION_PREFIXES = ("llm.", "ge.")
NATIVE_OPTION_PREFIX = "hixl."
LISTEN_OPTION = "llm.listenIpInfo"


def _exception(cann: Any, message: str, code: str = "LLM_PARAM_INVALID") -> Exception:
    exception: Exception = cann.LLMException(message, status_code=getattr(cann.LLMStatusCode, code))
    return exception


def checked_options(cann: Any, options: Any) -> Any:
    """``init`` options without the native engine's keys, refused if CANN would not take
    them as the back-end means them."""
    if not isinstance(options, dict):
        return options  # CANN raises its own TypeError
    options = {k: v for k, v in options.items() if not k.startswith(NATIVE_OPTION_PREFIX)}
    foreign = sorted(k for k in options if not k.startswith(CANN_OPTION_PREFIXES))
    if foreign:
        raise _exception(
            cann, f"option keys {foreign} are not CANN options (CANN's keys start with llm. or ge.)"
        )
    listen = options.get(LISTEN_OPTION)
    if listen is not None:
        _check_ipv4_listen(cann, listen)
    return options


def _check_ipv4_listen(cann: Any, value: Any) -> None:
    host, sep, port = str(value).rpartition(":")
    try:
        ipaddress.IPv4Address(host)
        valid = bool(sep) and port.isdigit() and int(port) <= 65535
    except ValueError:
        valid = False
    if not valid:
        raise _exception(
            cann,
            f'{LISTEN_OPTION} {value!r} must be "<IPv4 address>:<port>", such as 10.0.0.5:26000: '
            "CANN splits it at its one colon (so an IPv6 address fails init) and links by IPv4 "
            "literal only",
        )


class CheckedCacheManager:
    """CANN's CacheManager with the project's checks; everything else passes through."""

    def __init__(self, cann: Any, manager: Any) -> None:
        self.wrapped = manager
        self.linked = False
        self._cann = cann
        self._key_owner: dict[tuple[int, int], int] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.wrapped, name)

    def _check_before_link(self, func: str) -> None:
        if self.linked:
            raise _exception(
                self._cann,
                f"{func} after link_clusters: CANN accepts it, but memory registered after "
                "linking is not remotely accessible; register every cache before linking",
            )

    def register_blocks_cache(
        self,
        cache_desc: Any,
        addrs: Any,
        blocks_cache_key: Any = None,
        remote_accessible: bool | None = None,
    ) -> Any:
        self._check_before_link("register_blocks_cache")
        num_tensors = getattr(cache_desc, "num_tensors", None)
        if isinstance(addrs, list) and num_tensors is not None and len(addrs) != num_tensors:
            raise _exception(
                self._cann,
                f"register_blocks_cache: {len(addrs)} addresses for {num_tensors} tensors; "
                "give one base address per tensor",
            )
        key = None
        if isinstance(blocks_cache_key, self._cann.BlocksCacheKey):
            key = (blocks_cache_key.cluster_id, blocks_cache_key.model_id)
            if key in self._key_owner:
                raise _exception(
                    self._cann,
                    f"register_blocks_cache: BlocksCacheKey{key} is registered already (cache "
                    f"{self._key_owner[key]}); CANN would re-point it silently (last wins), so "
                    "give every cache its own model_id",
                    "LLM_FAILED",
                )
        cache = self.wrapped.register_blocks_cache(
            cache_desc, addrs, blocks_cache_key, remote_accessible
        )
        if key is not None:
            self._key_owner[key] = cache.cache_id
        return cache

    def register_cache(self, *args: Any, **kwargs: Any) -> Any:
        self._check_before_link("register_cache")
        return self.wrapped.register_cache(*args, **kwargs)

    def unregister_cache(self, cache_id: int) -> None:
        self.wrapped.unregister_cache(cache_id)
        self._key_owner = {k: c for k, c in self._key_owner.items() if c != cache_id}

    def pull_blocks(
        self,
        src_cache_key: Any,
        dst_cache: Any,
        src_blocks: Any = (),
        dst_blocks: Any = (),
        **kwargs: Any,
    ) -> None:
        transfer = Transfer(PULL_BLOCKS, src_cache_key, dst_cache, src_blocks, dst_blocks, kwargs)
        try:
            check(transfer, ascend_only=True)
        except LLMException as refused:  # raised as CANN's own exception, with its code
            raise _exception(self._cann, str(refused), refused.status_code.name) from None
        self.wrapped.pull_blocks(src_cache_key, dst_cache, src_blocks, dst_blocks, **kwargs)


def checked_classes(cann: Any) -> dict[str, Any]:
    """CANN's LLMConfig and LLMDataDist with the project's checks, under CANN's names."""

    class LLMConfig(cann.LLMConfig):
        def __setattr__(self, name: str, value: Any) -> None:
            check_option_name(self, name)
            super().__setattr__(name, value)

    class LLMDataDist(cann.LLMDataDist):
        def init(self, options: dict[str, str]) -> None:
            super().init(checked_options(cann, options))

        @property
        def cache_manager(self) -> CheckedCacheManager:
            manager = super().cache_manager
            checked = self.__dict__.get("_checked_cache_manager")
            if checked is None or checked.wrapped is not manager:  # a new one after re-init
                checked = CheckedCacheManager(cann, manager)
                self.__dict__["_checked_cache_manager"] = checked
            return checked

        def link_clusters(self, clusters: Any, timeout: int = 3000) -> Any:
            status, per_cluster = super().link_clusters(clusters, timeout)
            if any(code == cann.LLMStatusCode.LLM_SUCCESS for code in per_cluster):
                self.cache_manager.linked = True
            return status, per_cluster

    return {"LLMConfig": LLMConfig, "LlmConfig": LLMConfig, "LLMDataDist": LLMDataDist}
