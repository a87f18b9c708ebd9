"""Random small training steps for `magis bench fuzz`, with the op mix of real ones.

TASO verifies its substitutions by random testing (Jia's thesis §3.4: every rule on generated
inputs); here the generated inputs are whole training steps — forward, backward and an in-place
weight update (SGD or Adam) in float64 — assembled from the blocks real models are made of:
linear layers and MLPs, attention written out (three projections, scaled scores, a mask,
softmax, dropout), batch / layer / group norm, convolutions (strided, grouped, 1x1, on
channels-last inputs; padded explicitly under ReLU6 and leaky ReLU, as Hugging Face's
MobileNet pads), concatenations, chunks and channel slices, views, transposes, permutes and
expands, reductions, log-softmax, cross-entropy and MSE losses; last in a quarter of the
sequence models, an LSTM computed in float32 (oneDNN's fused `mkldnn_rnn_layer` on a CPU exists
for float32 only), which makes the whole step checked at float32's tolerance; and every
GRAPH_EVERY-th model a graph network, message passing over a random edge list in each way graph
code scatters (`magis.capture.models.gcn.SCATTERS`): fission's split along the edges.

Everything is drawn from one `random.Random`: a seed reproduces a model exactly (its spec, its
initial weights and its inputs). Sizes are drawn from small even and odd values alike, so that
fission's "n must divide the length" sees both."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from magis.capture import Step, training_step
from magis.capture.models.gcn import SCATTERS, propagate

SEQUENCE_BLOCKS = (
    "attention",
    "mlp",
    "layer_norm",
    "group_norm",
    "batch_norm",
    "chunk_cat",
    "factor",
    "distribute",
    "bmm",
    "reduce_gate",
    "log_softmax",
    "permute",
    "dropout",
)
IMAGE_BLOCKS = (
    "conv_bn",
    "conv_gn",
    "conv_cat",
    "channel_glu",
    "down_up",
    "depthwise",
    "pointwise",
    "channels_last",
    "residual",
)
FAMILIES = ("sequence", "image")
# Model 8, 17, 26 ... of a seed is a graph model; the others are drawn as before it joined, so
# the reproducers of earlier runs (tests/bench/test_fuzz.py) keep their models.
GRAPH_EVERY = 9


@dataclass(frozen=True)
class ModelSpec:
    """What one random training step is made of: readable in a reproducer."""

    family: str  # one of FAMILIES
    batch: int
    width: int  # features (sequence) or channels (image)
    length: int  # tokens, or the side of a square image
    blocks: tuple[str, ...]
    loss: str  # "cross_entropy" or "mse"
    optimizer: str  # "sgd" or "adam"
    classes: int
    embed: bool = False  # a sequence model reading token ids through an embedding
    channels_last: bool = False  # an image model's input in channels-last memory format
    recurrent: bool = False  # a sequence model's last block an LSTM in float32 (`Recurrent`)

    def describe(self) -> str:
        extra = " embed" if self.embed else " channels_last" if self.channels_last else ""
        extra += " lstm" if self.recurrent else ""
        return (
            f"{self.family} b={self.batch} w={self.width} l={self.length} "
            f"[{', '.join(self.blocks)}] {self.loss} {self.optimizer}{extra}"
        )


def random_spec(rng: random.Random, index: int = 0) -> ModelSpec:
    """A random model; `index` alternates the family and rotates two blocks every model of its
    family must have, so that a few consecutive models cover every block."""
    if index % GRAPH_EVERY == GRAPH_EVERY - 1:
        return _graph_spec(rng, index // GRAPH_EVERY)
    family = FAMILIES[index % 2]
    pool = SEQUENCE_BLOCKS if family == "sequence" else IMAGE_BLOCKS
    first = index // 2 * 2
    must = [pool[first % len(pool)], pool[(first + 1) % len(pool)]]
    blocks = [*must, *rng.choices(pool, k=rng.randint(0, 2))]
    rng.shuffle(blocks)
    return ModelSpec(
        family=family,
        batch=rng.choice((2, 3, 4)),
        width=rng.choice((4, 6, 8, 3, 5) if family == "sequence" else (4, 6, 3)),
        length=rng.choice((4, 6, 3, 5, 8) if family == "sequence" else (4, 6, 5)),
        blocks=tuple(blocks),
        loss=rng.choice(("cross_entropy", "mse")),
        optimizer=rng.choice(("sgd", "adam")),
        classes=rng.choice((2, 3, 4)),
        embed=family == "sequence" and rng.random() < 0.3,
        channels_last=family == "image" and rng.random() < 0.5,
        # drawn last, and True for the top quarter, so that the models of earlier runs'
        # reproducers stay as they were (one of tests/bench's gains a last LSTM block)
        recurrent=family == "sequence" and rng.random() >= 0.75,
    )


def _graph_spec(rng: random.Random, turn: int) -> ModelSpec:
    """A graph model: `length` nodes, `batch` edges per node, one propagation per block (the
    `turn`-th scatter of SCATTERS always among them)."""
    blocks = [SCATTERS[turn % len(SCATTERS)], *rng.choices(SCATTERS, k=rng.randint(0, 1))]
    return ModelSpec(
        family="graph",
        batch=rng.choice((2, 3, 4)),
        width=rng.choice((4, 6, 3, 5)),
        length=rng.choice((4, 6, 5, 8)),
        blocks=tuple(blocks),
        loss=rng.choice(("cross_entropy", "mse")),
        optimizer=rng.choice(("sgd", "adam")),
        classes=rng.choice((2, 3, 4)),
    )


# --- sequence blocks: x is (batch, tokens, width) ----------------------------------------------


def _heads(width: int) -> int:
    return 2 if width % 2 == 0 else 1


class Attention(nn.Module):
    """Scaled dot-product attention written out, with separate Q, K, V projections (a parallel
    group for the matmul-merging rule), a causal mask buffer, softmax and dropout."""

    def __init__(self, width: int, length: int) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.out = nn.Linear(width, width, bias=False)
        self.register_buffer("mask", torch.full((length, length), -1e4).triu(1))

    def forward(self, x):
        b, t, w = x.shape
        h = _heads(w)
        q, k, v = (p(x).view(b, t, h, w // h).transpose(1, 2) for p in (self.q, self.k, self.v))
        scores = q @ k.transpose(-1, -2) * (w // h) ** -0.5 + self.mask
        probs = F.dropout(scores.softmax(-1), 0.1, training=True)
        y = (probs @ v).permute(0, 2, 1, 3).reshape(b, t, w)
        return x + self.out(y)


class Mlp(nn.Module):
    def __init__(self, width: int, act: nn.Module) -> None:
        super().__init__()
        self.up, self.down, self.act = nn.Linear(width, 2 * width), nn.Linear(2 * width, width), act

    def forward(self, x):
        return x + self.down(self.act(self.up(x)))


class ChannelNorm(nn.Module):
    """A norm over the feature dimension of (batch, tokens, width): transposed around it.

    The transposed input is made contiguous: on a transposed one, CPU `native_batch_norm`
    returns a contiguous output where its fake kernel keeps the input's strides, so the
    captured program's later `view` fails before any rule runs (a capture bug, reported)."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, x):
        return self.norm(x.transpose(1, 2).contiguous()).transpose(1, 2).relu()


class ChunkCat(nn.Module):
    """Chunks, a gate, and a concatenation sliced again (concat/split algebra): a slice that is
    one input, and one within an input."""

    def forward(self, x):
        w = x.shape[-1]
        a, b = x.split([w // 2, w - w // 2], dim=2)
        joined = torch.cat([b * torch.sigmoid(a.sum(2, keepdim=True)), a], dim=2)
        return joined[:, :, : w - w // 2].sum(2, keepdim=True) + joined + joined[:, :, 1:2]


class Factor(nn.Module):
    """a*c + b*c: what the distributivity rule factors."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        c = torch.tanh(x)
        return self.a(x) * c + self.b(x) * c


class Distribute(nn.Module):
    """(a + b)*c: what the distributivity rule expands."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)

    def forward(self, x):
        return (self.a(x) + x) * F.silu(x)


class Bmm(nn.Module):
    def forward(self, x):  # the Gram matrix into a buffer it ignores, as diffusers' scores
        room = torch.empty(x.shape[0], x.shape[1], x.shape[1], dtype=x.dtype)  # beta 0
        gram = torch.baddbmm(room, x, x.transpose(1, 2), beta=0, alpha=1 / x.shape[-1])
        return torch.bmm(gram.softmax(-1), x) + x


class ReduceGate(nn.Module):
    """Reductions: a mean-centred input gated by a sum over tokens, broadcast by `expand`."""

    def forward(self, x):
        centred = x - x.mean(-1, keepdim=True)
        gate = torch.sigmoid(x.sum(1, keepdim=True)).expand_as(x)
        return centred * gate


class LogSoftmax(nn.Module):
    def forward(self, x):
        return x + F.log_softmax(x, dim=-1) * 0.5


class Permute(nn.Module):
    """Permute, a copy into a new shape, and back."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.mix = nn.Linear(width, width)

    def forward(self, x):
        b, t, w = x.shape
        y = self.mix(x).permute(2, 0, 1).reshape(w, b * t)
        return F.gelu(y.t().reshape(b, t, w))


class Dropout(nn.Module):
    def forward(self, x):
        return F.dropout(x, 0.2, training=True) + x


class Recurrent(nn.Module):
    """An LSTM layer added to its input, in float32 inside the float64 step: on a CPU nn.LSTM
    then runs oneDNN's fused kernel and its backward, which fission splits along the batch
    (their workspace passing from each forward part to its backward part)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(width, width, batch_first=True)

    def forward(self, x):
        return x + self.lstm(x.float())[0].to(x.dtype)


def _keep_float32(module: nn.Module) -> None:
    """`model.double()` made every weight float64: a `Recurrent` block's go back to float32."""
    if isinstance(module, Recurrent):
        module.float()


def sequence_block(name: str, width: int, length: int) -> nn.Module:
    table: dict[str, Callable[[], nn.Module]] = {
        "attention": lambda: Attention(width, length),
        "mlp": lambda: Mlp(width, nn.GELU()),
        "layer_norm": lambda: nn.Sequential(nn.LayerNorm(width), nn.SiLU()),
        "group_norm": lambda: ChannelNorm(nn.GroupNorm(_heads(width), width)),
        "batch_norm": lambda: ChannelNorm(nn.BatchNorm1d(width)),
        "chunk_cat": ChunkCat,
        "factor": lambda: Factor(width),
        "distribute": lambda: Distribute(width),
        "bmm": Bmm,
        "reduce_gate": ReduceGate,
        "log_softmax": LogSoftmax,
        "permute": lambda: Permute(width),
        "dropout": Dropout,
    }
    return table[name]()


# --- image blocks: x is (batch, channels, side, side) ------------------------------------------


def _conv(cin: int, cout: int, k: int = 3, **kw) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, k, padding=k // 2, **kw)


class ConvCat(nn.Module):
    """Two convolutions concatenated and convolved (U-Net++'s dense skips), the concatenation
    also batch-normalized (DenseNet's layers); the batch norm draws no weights, so a seed
    draws the weights it drew before it joined."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.a, self.b, self.merge = _conv(c, c), _conv(c, c, 1), _conv(2 * c, c)
        self.norm = nn.BatchNorm2d(2 * c)

    def forward(self, x):
        both = torch.cat([F.relu(self.a(x)), self.b(x)], dim=1)
        return self.merge(both) + self.norm(both).mean(1, keepdim=True)


class ChannelGlu(nn.Module):
    """A convolution read only in channel slices (a gated linear unit)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = _conv(c, 2 * c)

    def forward(self, x):
        y = self.conv(x)
        c = x.shape[1]
        return y[:, :c] * torch.sigmoid(y[:, c:]) + x


class DownUp(nn.Module):
    """A stride-2 convolution and nearest upsampling back to the input's side."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.down = _conv(c, c, stride=2)

    def forward(self, x):
        return F.interpolate(F.silu(self.down(x)), size=x.shape[-2:]) + x


class Depthwise(nn.Module):
    """A depthwise convolution as Hugging Face's MobileNet writes one: its input padded
    explicitly after a ReLU6, a leaky ReLU, and a "TensorFlow" pad that pads nothing. The
    convolution is made as `_conv` makes it (its padding applied by hand), so a seed draws the
    weights it drew when this block was a convolution and a GELU."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = _conv(c, c, groups=c)

    def forward(self, x):
        h = F.pad(F.relu6(x), (1, 1, 1, 1))
        y = F.conv2d(h, self.conv.weight, self.conv.bias, groups=self.conv.groups)
        return F.pad(F.leaky_relu(y, 0.1), (0, 0, 0, 0))


class Residual(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.body = nn.Sequential(_conv(c, c), nn.ReLU(), _conv(c, c, bias=False))

    def forward(self, x):
        return F.relu(x + self.body(x))


class ChannelsLast(nn.Module):
    """A convolution on a channels-last copy of its input (eager kernels then return
    channels-last gradients: the stride trap of issue 14)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = _conv(c, c)

    def forward(self, x):
        y = self.conv(x.contiguous(memory_format=torch.channels_last))
        return y.flatten(2).softmax(-1).view_as(x) * x.shape[-1] + y


class Contiguous(nn.Module):
    """Dropout here reads row-major. It was the workaround for dropout on a channels-last
    tensor, whose eager mask is drawn in memory order (the generated code now draws it so:
    `codegen._drawn_in_memory_order`); kept so that every seed builds the models it built."""

    def forward(self, x):
        return x.contiguous()


def image_block(name: str, c: int) -> nn.Module:
    groups = 2 if c % 2 == 0 else 1
    table: dict[str, Callable[[], nn.Module]] = {
        "conv_bn": lambda: nn.Sequential(_conv(c, c), nn.BatchNorm2d(c), nn.ReLU()),
        "conv_gn": lambda: nn.Sequential(_conv(c, c), nn.GroupNorm(groups, c), nn.SiLU()),
        "conv_cat": lambda: ConvCat(c),
        "channel_glu": lambda: ChannelGlu(c),
        "down_up": lambda: DownUp(c),
        "depthwise": lambda: Depthwise(c),
        "pointwise": lambda: nn.Sequential(_conv(c, c, 1), Contiguous(), nn.Dropout(0.1)),
        "channels_last": lambda: ChannelsLast(c),
        "residual": lambda: Residual(c),
    }
    return table[name]()


# --- whole models, losses and inputs -----------------------------------------------------------


class SequenceModel(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        w = spec.width
        self.embed = nn.Embedding(7, w) if spec.embed else nn.Linear(w, w)
        blocks = [sequence_block(b, w, spec.length) for b in spec.blocks]
        self.blocks = nn.Sequential(*blocks, *([Recurrent(w)] if spec.recurrent else []))
        self.head = nn.Linear(w, spec.classes)

    def forward(self, x):
        return self.head(self.blocks(self.embed(x)))  # (batch, tokens, classes)


class ImageModel(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        c = spec.width
        self.stem = _conv(3, c)
        self.blocks = nn.Sequential(*(image_block(b, c) for b in spec.blocks))
        self.head = nn.Linear(c, spec.classes)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))  # (batch, classes)


class GraphModel(nn.Module):
    """Node features (nodes, width) through a linear layer and a propagation per block over a
    fixed random edge list (buffers: the graph is the model's, as in full-graph training)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        w, nodes, edges = spec.width, spec.length, spec.batch * spec.length
        self.embed = nn.Linear(w, w)
        self.lins = nn.ModuleList(nn.Linear(w, w) for _ in spec.blocks)
        self.scatters = spec.blocks
        self.head = nn.Linear(w, spec.classes)
        self.register_buffer("edges", torch.randint(0, nodes, (2, edges)))
        self.register_buffer("weight", torch.rand(edges, dtype=torch.float64))

    def forward(self, x):
        h = self.embed(x)
        for lin, how in zip(self.lins, self.scatters, strict=True):
            h = torch.relu(propagate(lin(h), self.edges, self.weight, how))
        return self.head(h)  # (nodes, classes)


_MODELS = {"sequence": SequenceModel, "image": ImageModel, "graph": GraphModel}


def _loss(spec: ModelSpec) -> Callable[..., torch.Tensor]:
    if spec.loss == "cross_entropy":
        return lambda out, x, y: F.cross_entropy(out.reshape(-1, spec.classes), y.reshape(-1))
    return lambda out, x, y: F.mse_loss(out, y)


def _inputs(spec: ModelSpec, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    b, n, f64 = spec.batch, spec.length, torch.float64
    if spec.family == "graph":
        x = torch.randn(n, spec.width, generator=gen, dtype=f64)
        out_shape = (n, spec.classes)
    elif spec.family == "sequence":
        x = (
            torch.randint(0, 7, (b, n), generator=gen)
            if spec.embed
            else torch.randn(b, n, spec.width, generator=gen, dtype=f64)
        )
        out_shape = (b, n, spec.classes)
    else:
        x = torch.randn(b, 3, n, n, generator=gen, dtype=f64)
        if spec.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        out_shape = (b, spec.classes)
    if spec.loss == "cross_entropy":
        y = torch.randint(0, spec.classes, out_shape[:-1], generator=gen)
    else:
        y = torch.randn(out_shape, generator=gen, dtype=f64)
    return x, y


def build_model(spec: ModelSpec, seed: int) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The float64 model of `spec` with weights drawn from `seed`, and its inputs."""
    torch.manual_seed(seed)
    model = _MODELS[spec.family](spec).double().train()
    model.apply(_keep_float32)
    return model, _inputs(spec, torch.Generator().manual_seed(seed))


def random_step(seed: int, index: int = 0) -> tuple[ModelSpec, Step]:
    """The `index`-th random model of `seed`, captured as a training step."""
    spec = random_spec(random.Random(f"model {seed} {index}"), index)
    model, inputs = build_model(spec, seed * 1_000_003 + index)
    step = training_step(model, inputs, loss_fn=_loss(spec), optimizer=spec.optimizer)
    return spec, step
