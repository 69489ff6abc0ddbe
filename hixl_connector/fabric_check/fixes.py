"""What to change when a step of the fabric check fails: the rules each Ascend fabric keeps
(HCCS moves device memory only, 2 MB-aligned; RoCE host memory comes from aclrtMallocHost;
host-device pulls need a device pool) and the set-up a link needs."""

from __future__ import annotations

from hixl_connector.datadist import BackendUnavailableError

ALIGNMENT = (
    "allocate the KV cache 2 MB aligned (aclrtMalloc with ACL_MEM_MALLOC_HUGE_ONLY; "
    "vllm-ascend does), or set kv_connector_extra_config 'ascend_hccs': false where P and D "
    "link over RoCE only"
)
LINK = (
    "check that D reaches P's engine host and port (firewall; the NIC's address, never "
    "127.0.0.1 on Ascend), that the RoCE NICs are up (hccn_tool -i <npu> -link -g; containers "
    "mount /etc/hccn.conf), HCCL_INTRA_ROCE_ENABLE=1 for RDMA inside one host, and that every "
    "registered buffer is device memory at a 2 MB-aligned base (HCCS) or host memory from "
    "aclrtMallocHost (RoCE): the placements above"
)
NOT_CARRIED = (
    "this fabric does not move these memories: HCCS carries device memory only (on A3 also a "
    "local host buffer to or from remote device memory); keep the KV cache and its words on "
    "the NPU (the placements above should all read DEVICE); a pull between host and device "
    "needs a device memory pool of at least 100 MB"
)
TIMEOUT = (
    "the read outlived pull_timeout_s: check the link's bandwidth and errors (hccn_tool "
    "-i <npu> -stat -g), and raise pull_timeout_s for slow links"
)
GUARD = (
    "P's lease words are not where D reads them: both sides must run this hixl_connector "
    "version and register the words with the KV's placement"
)
VERIFY = (
    "bytes landed wrong: the fabric or the registrations' addresses are not what they claim; "
    "rerun with one NPU per side and report the output"
)
MISSING = (
    "install the back-end's packages (CANN's llm_datadist and torch_npu on Ascend), or check "
    "the native engine with --backend native"
)


def fix_for(stage: str, error: BaseException) -> str:
    """The change most likely to make ``stage`` pass after ``error``."""
    code = str(getattr(getattr(error, "status_code", None), "name", ""))
    text = str(error)
    if isinstance(error, BackendUnavailableError):
        return MISSING
    if "2 MB" in text or "not 2 MB aligned" in text:
        return ALIGNMENT
    if code == "LLM_FEATURE_NOT_ENABLED" or "memory pool" in text:
        return NOT_CARRIED
    if code == "LLM_TIMEOUT" or isinstance(error, TimeoutError):
        return TIMEOUT
    if stage == "link" or "LLM_LINK_FAILED" in text:
        return LINK
    if stage == "guard":
        return GUARD
    if stage == "verify":
        return VERIFY
    return "read the error above; the placements and the fabric show what was attempted"
