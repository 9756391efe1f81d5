"""Each LoRA's second product folded into its frozen GEMM's K, where the device's capabilities ask
for it (`lora_fold`; KRNL_LORA_FOLD=0 or 1 overrides, to time or test both ways).

For a group of linears reading one x (q, k and v; gate and up), grouped as lora_group.py groups
them, t = x A_g^T (rows, G r) and each output j of the group (q|k|v is one, gate and up two) is

    y_j = x W_j^T + sum_i s_i t_i B_i^T = [x | t] [W_j | S_j]^T          K = in + G r

with S_j (out_j, G r) holding s_i B_i in member i's rows and r columns, zeros elsewhere. One GEMM
writes y_j where the frozen product and the rank-r one each made a pass over it, the second
reading it back with beta 1 (docs/performance.md, 'The LoRA products on CUDA'). The norm writes
x into the first `in` columns of one (rows, in + G r) buffer and the t GEMM the rest; W_j lives in
the first columns of Wk_j = [W_j | S_j], and the layer's frozen weight is that view. S_j is
rewritten from the B's at every call, so no optimizer step or loaded adapter needs a hook: one
small GEMM a member against an r x r identity (a GEMM writes at a row stride, and a product with
I is exact), rounding s_i B_i to the compute dtype once. The groups' backward is lora_group's.

The o and down projections fold their backward instead (LoraLinear._fold_backward): with dt =
s dy B written beside dy in one (rows, out + r) buffer and W stored with A's rows after its own,

    dx = dy W + dt A = [dy | dt] [W ; A]                                  K = out + r

the rank-r product no longer writes dx for the frozen one to read back. Their dy are the
residual stream's gradients, which rmsnorm_backward writes at the wider buffer's row stride."""

import os
from dataclasses import dataclass

import numpy as np

from .. import _core
from .lora import LoraSaved
from .lora_group import GroupSaved, groupable, stacked_A
from ..quant.qweight import QuantizedArray

ops = _core.ops


def wanted(device, quantize, arrays, factors):
    """Whether a group's frozen weights are stored for the fold: the device's policy (or
    KRNL_LORA_FOLD), dense weights, every member adapted at one rank."""
    env = os.environ.get("KRNL_LORA_FOLD")
    on = device.capabilities()["lora_fold"] if env is None else env != "0"
    return (on and quantize is None and not any(isinstance(a, QuantizedArray) for a in arrays)
            and all(f is not None for f in factors) and len({f.A.shape for f in factors}) == 1)


def norm_output(fold, lins, call_seed, device, rows, cols, dtype):
    """(xw, xn): the buffer a group's input norm writes. Where this call folds (a Fold whose
    members group: no dropout drawn; rows enough for the fold to pay), xw (rows, cols + G r) and
    xn its first cols columns; else (None, a (rows, cols) tensor)."""
    if fold is None or not fold.pays(rows) or not groupable(lins, call_seed):
        return None, device.empty((rows, cols), dtype)
    xw = device.empty((rows, cols + fold.g), dtype)                       # (rows, cols + G r): x | t
    return xw, xw[:, :cols]


def rows_for_A(device, dtype, array, r):
    """(Wk, W) for a linear whose backward folds (LoraLinear): its frozen weight (out, in) in the
    first rows of Wk (out + r, in), the r rows after it zero until a backward copies A there;
    W = Wk[:out], so the forward reads W as before."""
    W = np.asarray(array, np.float32)
    Wk = device.tensor(np.concatenate([W, np.zeros((r, W.shape[1]), np.float32)]), dtype)
    return Wk, Wk[:W.shape[0]]


@dataclass
class Fold:
    """The widened weights of one group and where each member's S block goes."""
    Wk: list            # per output j: (out_j, in + G r) in the compute dtype
    blocks: list        # per member i: (j, r0, r1), its output and rows there
    inp: int            # in: the columns of W
    eye: _core.Tensor   # (r, r) identity in the compute dtype

    @classmethod
    def upload(cls, device, dtype, outputs, blocks, r):
        """outputs: per output j, the float arrays of its W stacked by rows; returns the Fold and
        each output's W (a view of Wk_j's first columns)."""
        G = len(blocks)
        Wk = []
        for arrays in outputs:
            W = np.concatenate([np.asarray(a, np.float32) for a in arrays])
            wide = np.zeros((W.shape[0], W.shape[1] + G * r), np.float32)   # S starts at 0: set per call
            wide[:, :W.shape[1]] = W
            Wk.append(device.tensor(wide, dtype))
        inp = Wk[0].shape[1] - G * r
        fold = cls(Wk, blocks, inp, device.tensor(np.eye(r, dtype=np.float32), dtype))
        return fold, [w[:, :inp] for w in Wk]

    @property
    def g(self):
        return self.Wk[0].shape[1] - self.inp

    def pays(self, rows):
        """Whether folding a call of `rows` rows moves fewer bytes, each operand counted once:
        it saves the rank-r products' write of y and the frozen GEMM's read of it (2 rows N) and
        costs S's rewrite and the reading of its zero blocks (N (G + 1) r + G r^2;
        docs/architecture.md, 'The fold on Metal'). A decode step's few rows do not pay."""
        r = self.eye.shape[0]
        G, N = self.g // r, sum(w.shape[0] for w in self.Wk)
        return 2 * rows * N > (G + 1) * r * N + G * r * r

    def forward(self, lins, xw, ys):
        """ys[j] = [x | t] Wk_j^T for xw (rows, in + G r) holding x in its first in columns (t is
        written here); returns (one LoraSaved per member, the GroupSaved) for group_backward."""
        A, r, gA = stacked_A(lins)
        x, t = xw[:, :self.inp], xw[:, self.inp:]
        ops.gemm(x, A, t, trans_b=True)                                   # t_g = x A_g^T
        for i, (lin, (j, r0, r1)) in enumerate(zip(lins, self.blocks)):
            c0 = self.inp + i * r
            ops.gemm(lin.factors.B, self.eye, self.Wk[j][r0:r1, c0:c0 + r], alpha=lin.scale)  # S block = s_i B_i
        for Wk, y in zip(self.Wk, ys):
            ops.gemm(xw, Wk, y, trans_b=True)                             # y_j = [x | t] [W_j | S_j]^T
        return [LoraSaved(x, t[:, i * r:(i + 1) * r], None) for i in range(len(lins))], GroupSaved(A, r, gA)
