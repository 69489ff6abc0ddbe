"""LLMRole and LLMClusterInfo of the LLM-DataDist v2 API, and CANN's little-endian IPv4
integers."""

from __future__ import annotations

import socket
from enum import IntEnum

from hixl_connector.datadist.api.c_types import check_isinstance, check_uint16, check_uint64


class LLMRole(IntEnum):
    PROMPT = 1
    DECODER = 2
    MIX = 3

    def __str__(self) -> str:
        return f"{self.__class__.__name__}.{self.name}"


def ip_to_int(ip: str | int) -> int:
    """IPv4 dotted string -> little-endian int, as CANN stores it."""
    if isinstance(ip, int):
        return ip
    try:
        return int.from_bytes(socket.inet_aton(ip), byteorder="little")
    except OSError:
        raise RuntimeError(f"Can not parse ip str:{ip}") from None


def int_to_ip(ip: int) -> str:
    return socket.inet_ntoa(ip.to_bytes(4, byteorder="little"))


class LLMClusterInfo:
    """One peer for ``link_clusters`` / ``unlink_clusters``."""

    def __init__(self) -> None:
        self._remote_cluster_id: int | None = None
        self._remote_role_type: LLMRole | int | None = None
        self._local_ip_info_list: list[tuple[int, int]] = []
        self._remote_ip_info_list: list[tuple[int, int]] = []

    @property
    def remote_cluster_id(self) -> int | None:
        return self._remote_cluster_id

    @remote_cluster_id.setter
    def remote_cluster_id(self, value: int) -> None:
        check_uint64("remote_cluster_id", value)
        self._remote_cluster_id = value

    @property
    def remote_role_type(self) -> LLMRole | int | None:
        return self._remote_role_type

    @remote_role_type.setter
    def remote_role_type(self, value: LLMRole | int) -> None:
        check_isinstance("remote_role_type", value, (LLMRole, int))
        self._remote_role_type = value

    @property
    def local_ip_info_list(self) -> list[tuple[int, int]]:
        return self._local_ip_info_list

    @property
    def remote_ip_info_list(self) -> list[tuple[int, int]]:
        return self._remote_ip_info_list

    @staticmethod
    def _checked_ip(ip: str | int, port: int) -> int:
        check_isinstance("ip", ip, (str, int))
        check_uint16("port", port)
        return ip_to_int(ip)

    def append_local_ip_info(self, ip: str | int, port: int) -> None:
        self._local_ip_info_list.append((self._checked_ip(ip, port), port))

    def append_remote_ip_info(self, ip: str | int, port: int) -> None:
        self._remote_ip_info_list.append((self._checked_ip(ip, port), port))
