"""The model's linear layers on a CPU: oneDNN's kernels on weights reordered once into its blocked layout, and
products of one to three rows through MKL's on an Intel CPU.

PyTorch's float32 ``linear`` on a CPU calls MKL. oneDNN, which PyTorch ships too, multiplies by a weight it has
reordered once (``mkldnn._reorder_linear_weight``, what ``torch.compile`` does to a frozen CPU model) faster at
every number of rows a chat runs on an AMD CPU (issue 23, SmolLM2's 576 → 1536 layer on two threads: 1 row 0.074 →
0.046 ms, 5 rows 0.180 → 0.067, 17 rows 0.327 → 0.166, 108 rows 1.137 → 0.888; the 49,152-token output head on 5
rows 10.2 → 4.7 ms). Each output is the same dot product summed in another order (float32 rounding, about 1e-6 of
its size): the exactness tests compare kvlab's model, with these layers, against transformers' own eager model with
PyTorch's.

The reordered weight is a copy beside the layer's own (which the rest of the model and kvlab still read: a tied
output head is the input embedding): a model packs while its linear weights take at most ``PACK_BYTES``; a larger
one calls oneDNN on the weights as they are (no copy, about 1.5× ``linear``'s speed on a few rows, 1.1× on a
hundred). Other devices, dtypes, CPUs and gradients keep ``linear``.

A few rows (a decoding step of one to three sequences) make a matrix–vector-like product, where the faster library
depends on the CPU: on a 2-core Intel Xeon, MKL's took SmolLM2's 210 layers 19.8 ms against oneDNN's 28.4 ms for one
row on two threads, 23.7 against 29.7 ms for two and 25.1 against 29.4 ms for three, where from four rows on
oneDNN's was faster (33.5 against 37.4 ms). Moving one row to MKL took a 16-token follow-up of Full alone from 1.03
to 0.82 s; moving two and three rows took one of Full and Quest from 1.94 to 1.59 s. On the AMD CPU above oneDNN's
was 1.6× faster for one row. MKL is Intel's library, so products of at most ``FEW_ROWS`` rows on an Intel CPU go to
``linear``. The choice follows the CPU's vendor, not a timing at load: a timing near a tie could choose differently
in two processes on one machine (the app and its Ray workers), and their float32 rounding, which must agree bit for
bit, with it.
"""

from __future__ import annotations

import platform
from types import MethodType

import torch
import torch.nn.functional as F
from torch import nn

PACK_BYTES = 2 << 30  # linear weights a model may hold twice: once as loaded, once reordered for oneDNN
X86 = ("x86_64", "amd64")
FEW_ROWS = 3  # products of at most this many rows go to MKL on an Intel CPU (above: measured there)


def _onednn(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` of x [..., in] → [..., out] through oneDNN, on the reordered weight where there is one."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or self.weight.dtype != torch.float32 or (
            torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, self.weight, self.bias))):
        return F.linear(x, self.weight, self.bias)
    if x.numel() <= FEW_ROWS * x.shape[-1] and self.__dict__.get("_few_rows_linear"):
        return F.linear(x, self.weight, self.bias)
    return _pointwise(self, x)


def _pointwise(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """oneDNN's product of x [..., in] by the layer's weight → [..., out]."""
    return torch.ops.mkldnn._linear_pointwise(x, _reordered(self), self.bias, "none", [], "")


def _reordered(self: nn.Linear) -> torch.Tensor:
    """The layer's weight for oneDNN: reordered, where it packs, as the weight is now (one that was replaced, moved or
    changed in place is reordered again; a change through ``.data`` bypasses the version counter and is not seen);
    else the weight itself."""
    weight = self.weight
    if not self.__dict__.get("_onednn_pack") or weight.device.type != "cpu" or weight.dtype != torch.float32:
        return weight
    seen = (weight._version, weight.data_ptr())
    packed = self.__dict__.get("_onednn_weight")
    if packed is None or packed[0] is not weight or packed[1] != seen:
        packed = self.__dict__["_onednn_weight"] = (weight, seen,
                                                    torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None))
    return packed[2]


def onednn_linears(model: nn.Module) -> None:
    """Give every ``nn.Linear`` of ``model`` oneDNN's product (subclasses, which may compute otherwise, keep their own
    forward); on a CPU that is not x86 (where it was not measured) or without oneDNN in this PyTorch build every layer
    keeps ``linear``."""
    if (platform.machine().lower() not in X86 or not torch.backends.mkldnn.is_available()
            or not hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    pack = sum(m.weight.numel() * m.weight.element_size() for m in linears) <= PACK_BYTES
    for module in linears:
        module.__dict__["_onednn_pack"] = pack
        module.forward = MethodType(_onednn, module)
        _reordered(module)  # now: the copy's memory is the model's from the start
    few_rows = cpu_vendor() == "GenuineIntel"
    for module in linears:
        module.__dict__["_few_rows_linear"] = few_rows


def cpu_vendor() -> str:
    """The x86 CPU's vendor string ("GenuineIntel", "AuthenticAMD", …) from Linux's /proc/cpuinfo or, elsewhere,
    what ``platform`` names; "" where neither says."""
    named = platform.processor()
    return cpuinfo("vendor_id") or next((v for v in ("GenuineIntel", "AuthenticAMD") if v in named), "")


def cpuinfo(field: str) -> str:
    """The first value of ``field`` ("vendor_id", "model name", …) in Linux's /proc/cpuinfo; "" where it has none."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def few_rows_library(model: nn.Module) -> str:
    """What computes the model's products of at most ``FEW_ROWS`` rows: "linear" (PyTorch's, MKL on an x86 CPU) or
    "oneDNN"."""
    first = next((m for m in model.modules() if type(m) is nn.Linear), None)
    return "oneDNN" if first is not None and first.__dict__.get("_few_rows_linear") is False else "linear"
