# Environment for a hixl_connector P or D server on Atlas A2/A3 (source it, then start vLLM).
# Edit the values marked EDIT. Not yet exercised on hardware (see README.md).

# CANN toolkit (path of a default installation).
source /usr/local/Ascend/ascend-toolkit/set_env.sh

# EDIT: the NPUs of this server (P and D on one node must not share any).
export ASCEND_RT_VISIBLE_DEVICES=0,1,2,3

# EDIT: this host's address on the NIC that carries HCCL traffic; never a loopback address.
export HCCL_IF_IP=${HCCL_IF_IP:-10.0.0.11}

# RDMA retry budget: 4.096 us x 2^HCCL_RDMA_TIMEOUT x HCCL_RDMA_RETRY_CNT (+3 s) is about 33 s;
# pull_timeout_s in the JSON (35 s) must cover it.
export HCCL_RDMA_TIMEOUT=20
export HCCL_RDMA_RETRY_CNT=7

# Only when P and D sit on one host but must talk over RoCE instead of HCCS.
# export HCCL_INTRA_ROCE_ENABLE=1

# The P/D servers never need HF downloads once the model is local.
export HF_HUB_OFFLINE=1
