"""An analytic roofline cost model with hardware presets (MAGIS §2.3, §7.2.3; thesis §2.6).

time = launch overhead + max(FLOPs / (peak FLOP/s x utilization), bytes / (bandwidth x utilization))

Utilization falls for small operators, and that is what makes fission (splitting an op into n
parts run one after another) cost time: MAGIS trades memory for "more operator calls and
decreased hardware utilization" (§2.3), and its latency/memory curves (§7.2.3, Fig. 11) are the
price of that trade. Both utilizations are Hockney's saturating curve r = r_inf * n / (n + n_1/2)
(Hockney, "The communication challenge for MPP", 1994): the time of n units of work is then
(n + n_1/2) / r_inf, a throughput term plus a fixed one.

- Matmul and convolution class ops (tensor cores; fp32 runs as TF32, as the paper ran it) are
  measured in output tiles of `tile_elems` elements, one tile per SM at a time. The last wave of
  tiles is only partly full; with tile counts spread evenly over a wave its expected idle time is
  half a tile's run time, which is exactly util = tiles / (tiles + sm_count / 2) (n_1/2 = half a
  wave). A 4096^3 fp32 mm on an RTX 3090 has 1024 tiles (12.5 waves, util 96%); split in two,
  512 tiles each (util 93%): +4% in total, about what real wave quantization costs it. Small
  outputs with a deep reduction use split-K, as cuBLAS does, until a wave is full.
- Every other op, and the memory side of every op, is measured in bytes moved, with n_1/2 the
  bytes that must be in flight to cover DRAM latency (Little's law: bandwidth x ~1 us).
- `launch_overhead` is paid by every op: for tiny ops it dominates, so a 64^3 mm split in 8
  costs about 8x as much as the whole.

Wave quantization with exact `ceil` was not used: it makes time non-monotone in op size (a
slightly bigger op can be faster per FLOP), and the tile a library picks is unknown here.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from magis.cost.base import CostModel, OpCall, OpKey
from magis.ir.ops import bytes_moved, flops_of, tensor_metas
from magis.ir.tensor import TensorMeta

# Bytes that must be in flight to keep DRAM busy = bandwidth x loaded latency (Little's law).
# GPU DRAM latency is a few hundred ns unloaded (microbenchmark studies of Volta and Ampere) and
# grows under load; 1 us is a round figure that also absorbs the ramp-up and tail of a kernel.
DRAM_LATENCY_S = 1e-6
# 128 x 128 outputs per thread block is the common CUTLASS / cuBLAS tile for large GEMMs.
GEMM_TILE_ELEMS = 128 * 128
# cuBLAS splits the reduction (split-K) of a small-output GEMM, down to chunks of about this depth.
SPLIT_K_MIN_DEPTH = 256
# Launch latency plus the gap between back-to-back kernels in eager PyTorch: NVIDIA's "Getting
# Started with CUDA Graphs" blog measures ~3-4 us per short kernel issued from a stream.
GPU_LAUNCH_S = 4e-6


@dataclass(frozen=True)
class Peaks:
    """Peak FLOP/s by compute dtype. Integer, bool and complex ops use the float32 figure."""

    float64: float
    float32: float
    float16: float
    bfloat16: float

    def of(self, dtype: str) -> float:
        if dtype in ("float64", "float16", "bfloat16"):
            return getattr(self, dtype)
        return self.float32


@dataclass(frozen=True)
class Hardware:
    """What the roofline needs of a device; every figure is dense (no 2:4 sparsity)."""

    name: str
    matmul_flops: Peaks  # matmul / convolution class (tensor cores; float32 means TF32)
    vector_flops: Peaks  # every other op (CUDA cores)
    mem_bandwidth: float  # device memory, bytes/s
    launch_overhead: float  # s per op (kernel launch) and per copy
    host_bandwidth: float  # host <-> device copies, achievable bytes/s (pinned memory)
    sm_count: int  # tiles that run at once
    tile_elems: int = GEMM_TILE_ELEMS
    mem_half_bytes: float | None = None  # n_1/2 of the memory side; None: bandwidth x DRAM latency
    copy_engine: bool = True  # Store/Load overlap compute (a GPU's copy engines; not a CPU)

    @property
    def memory_half(self) -> float:
        if self.mem_half_bytes is not None:
            return self.mem_half_bytes
        return self.mem_bandwidth * DRAM_LATENCY_S


# GeForce RTX 3090, the paper's card (NVIDIA Ampere GA102 whitepaper v2, Appendix A): 82 SMs,
# 35.6 TFLOP/s FP32 (and FP16/BF16) on CUDA cores, 35.6 TF32 tensor, 71 FP16/BF16 tensor with
# FP32 accumulate (GeForce runs FP32 accumulation at half the FP16-accumulate rate of 142),
# FP64 at 1/64 rate; 936 GB/s GDDR6X; PCIe 4.0 x16 (31.5 GB/s raw, ~25 achievable).
RTX3090 = Hardware(
    name="rtx3090",
    matmul_flops=Peaks(float64=0.556e12, float32=35.6e12, float16=71e12, bfloat16=71e12),
    vector_flops=Peaks(float64=0.556e12, float32=35.6e12, float16=35.6e12, bfloat16=35.6e12),
    mem_bandwidth=936e9,
    launch_overhead=GPU_LAUNCH_S,
    host_bandwidth=25e9,
    sm_count=82,
)
# A100 40GB SXM4 (NVIDIA A100 datasheet; Ampere GA100 whitepaper): 108 SMs, 19.5 FP32,
# 156 TF32, 312 FP16/BF16 tensor, 19.5 FP64 tensor, 9.7 FP64, 78 FP16 / 39 BF16 non-tensor;
# 1555 GB/s HBM2; PCIe 4.0 x16.
A100 = Hardware(
    name="a100",
    matmul_flops=Peaks(float64=19.5e12, float32=156e12, float16=312e12, bfloat16=312e12),
    vector_flops=Peaks(float64=9.7e12, float32=19.5e12, float16=78e12, bfloat16=39e12),
    mem_bandwidth=1555e9,
    launch_overhead=GPU_LAUNCH_S,
    host_bandwidth=25e9,
    sm_count=108,
)
# H100 SXM5 (NVIDIA H100 datasheet, dense figures): 132 SMs, 67 FP32, 495 TF32, 989 FP16/BF16
# tensor, 67 FP64 tensor, 34 FP64, 134 FP16/BF16 non-tensor; 3.35 TB/s HBM3; PCIe 5.0 x16
# (63 GB/s raw, ~50 achievable).
H100 = Hardware(
    name="h100",
    matmul_flops=Peaks(float64=67e12, float32=495e12, float16=989e12, bfloat16=989e12),
    vector_flops=Peaks(float64=34e12, float32=67e12, float16=134e12, bfloat16=134e12),
    mem_bandwidth=3350e9,
    launch_overhead=GPU_LAUNCH_S,
    host_bandwidth=50e9,
    sm_count=132,
)
# A modest multi-core x86 CPU, the fallback for ops the profiler cannot run: AVX2 FMA gives
# 32 fp32 FLOP/cycle/core (2 cores at ~3 GHz ~ 190 GFLOP/s peak, ~100 reached by oneDNN GEMMs),
# elementwise ATen kernels reach ~10 GFLOP/s, ~20 GB/s DRAM, ~10 us Python + dispatcher per op.
CPU = Hardware(
    name="cpu",
    matmul_flops=Peaks(float64=50e9, float32=100e9, float16=25e9, bfloat16=25e9),
    vector_flops=Peaks(float64=5e9, float32=10e9, float16=2.5e9, bfloat16=2.5e9),
    mem_bandwidth=20e9,
    launch_overhead=10e-6,
    host_bandwidth=10e9,
    sm_count=2,
    tile_elems=64 * 64,
    mem_half_bytes=64e3,  # about an L2 cache: smaller ops run from cache at dispatch speed
    copy_engine=False,
)

HARDWARE_PRESETS: MappingProxyType[str, Hardware] = MappingProxyType(
    {hw.name: hw for hw in (RTX3090, A100, H100)}
)


def matmul_utilization(hw: Hardware, flops: float, out_elems: int) -> float:
    """Fraction of the tensor-core peak a matmul/conv class op reaches (see module docstring)."""
    if flops <= 0 or out_elems <= 0:
        return 1.0
    depth = flops / (2.0 * out_elems)  # reduction length: K for mm, Cin*kh*kw for conv
    tiles = out_elems / hw.tile_elems
    split_k = max(1.0, min(hw.sm_count / tiles, depth / SPLIT_K_MIN_DEPTH))
    units = tiles * split_k
    return units / (units + hw.sm_count / 2)


def memory_utilization(hw: Hardware, nbytes: float) -> float:
    """Fraction of the memory bandwidth an op moving `nbytes` reaches (Hockney, n_1/2 in bytes)."""
    if nbytes <= 0:
        return 1.0
    return nbytes / (nbytes + hw.memory_half)


def compute_dtype(args: tuple, outputs: tuple[TensorMeta, ...]) -> str:
    """The dtype that decides the peak: the first tensor argument's, else the first output's."""
    metas = tensor_metas(args) or list(outputs)
    return metas[0].dtype if metas else "float32"


_CONV_BACKWARD = "aten.convolution_backward.default"
_NO_GRADIENT = TensorMeta((0,), "float32", 4)  # a gradient the mask turns off


def kernel_calls(call: OpCall) -> list[OpCall]:
    """The kernels one op call runs as. A convolution backward asked for the input gradient
    and the weight (or bias) gradient runs two: cuDNN and oneDNN have separate backward-data
    and backward-weights kernels, and ATen calls both. Each has its own shape, so its own
    utilization: the weight gradient is a small output with a deep reduction (split-K). Costed
    as one op, it got the input gradient's utilization, and a split into the two ops seemed
    to cost 25% more (unet)."""
    if call.op != _CONV_BACKWARD or len(call.args) != 11:
        return [call]
    mask = call.args[10]
    if not (mask[0] and (mask[1] or mask[2])):
        return [call]
    args, outs, kwargs = call.args[:10], call.outputs, call.key.kwargs
    dgrad = OpKey(call.op, (*args, (True, False, False)), kwargs, (outs[0], *[_NO_GRADIENT] * 2))
    wgrad = OpKey(call.op, (*args, (False, *mask[1:])), kwargs, (_NO_GRADIENT, *outs[1:]))
    return [OpCall(dgrad, call.info), OpCall(wgrad, call.info)]


def roofline_time(hw: Hardware, call: OpCall) -> float:
    """Seconds one call takes on `hw`: per kernel, launch + max(compute, memory), both
    utilization-scaled."""
    return sum(_kernel_time(hw, k) for k in kernel_calls(call))


def _kernel_time(hw: Hardware, call: OpCall) -> float:
    args, kwargs, outs = call.args, call.kwargs, call.outputs
    flops = flops_of(call.info, args, kwargs, outs)
    nbytes = bytes_moved(call.info, args, kwargs, outs)
    dtype = compute_dtype(args, outs)
    mem_util = memory_utilization(hw, nbytes)
    if call.info.compute_bound:
        out_elems = sum(o.numel for o in outs)
        peak = hw.matmul_flops.of(dtype) * matmul_utilization(hw, flops, out_elems)
    else:  # one thread per element: parallelism follows the data, as on the memory side
        peak = hw.vector_flops.of(dtype) * mem_util
    compute = flops / peak if flops > 0 else 0.0
    memory = nbytes / (hw.mem_bandwidth * mem_util) if nbytes > 0 else 0.0
    return hw.launch_overhead + max(compute, memory)


class RooflineModel(CostModel):
    """Op times from a `Hardware` description (no device needed): the analytic presets."""

    def __init__(self, hardware: Hardware = RTX3090) -> None:
        super().__init__()
        self.hardware = hardware
        self.name = hardware.name
        self.copies_overlap = hardware.copy_engine

    def estimate(self, call: OpCall) -> float:
        return roofline_time(self.hardware, call)

    def transfer_time(self, nbytes: int) -> float:
        """One Store or Load over PCIe: a copy launch plus nbytes at the achievable bandwidth."""
        if nbytes <= 0:
            return 0.0
        return self.hardware.launch_overhead + nbytes / self.hardware.host_bandwidth
