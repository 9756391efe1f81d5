"""W2 and W3 (docs/performance.md, 'Workloads'): one LoRA training step of a single Llama layer, as krnl runs it
and as each peer runs it. W3, the Llama-3-8B layer, is the same step at other sizes, with GQA.

    W2: 16 heads of 128 (MHA), RoPE (rotate-half), causal, LoRA r=32 on q, k, v, o, gate, up,
        down; T=512 (B=1), C=2048, F=5632, RMSNorm eps 1e-6 (Llama 2); frozen base weights.
    W3: 32 query heads / 8 KV heads of 128, T=4096, C=4096, F=14336, r=16, eps 1e-5 (Llama 3).
    Both: lora_alpha = 2r (scale 2, PEFT's usual choice); the dtype is the device's compute
    dtype (f32 on the CPU, bf16 on CUDA) unless the caller names another.

krnl runs it as a LlamaModel with num_hidden_layers=1 and vocab 256: embedding lookup, the layer,
the final RMSNorm, an LM head of 256 rows and the mean cross entropy. The head is 2*2*T*V*C =
1.07 GFLOP at W2 (forward + dX), under 1% of the layer's 115.5, and is not counted in the GFLOP/s.
One training step = forward + backward to the 14 LoRA gradients and the gradient at the layer
input (the embedding output), no optimizer: the work PyTorch does in loss.backward().

Every implementation is a builder `build(case) -> (step, result)`; `result()` runs one step and
returns {"loss", "dx", <14 PEFT LoRA keys>} as numpy f32. krnl's are here, the peers' (numpy,
PyTorch, MLX) in w2_peers.py."""

import math

import numpy as np

import krnl
from krnl.models.model import LlamaModel
from krnl.models.config import LoraConfig, ModelConfig, lora_key, random_weights, ALL_MODULES
from krnl.models.step_inputs import DeviceInputs
from .targets import replayed

T, C, F, H, D, R, V = 512, 2048, 5632, 16, 128, 32, 256
EPS = 1e-6
W2 = dict(C=C, F=F, H=H, D=D, T=T, r=R)
SMALL = dict(C=64, F=176, H=4, D=16, T=33, r=32, seed=3)  # the cross-check size
QUICK = dict(C=256, F=704, H=4, D=64, T=64, r=8)
W3 = dict(C=4096, F=14336, H=32, KV=8, D=128, T=4096, r=16, eps=1e-5)  # Llama-3-8B layer, for the H200
W3_QUICK = dict(C=256, F=896, H=8, KV=2, D=32, T=64, r=16, eps=1e-5)
W3_SMALL = dict(C=64, F=176, H=4, KV=2, D=16, T=33, r=16, eps=1e-5, seed=3)


def w2_flops(T=T, C=C, F=F, H=H, D=D, R=R, KV=None):
    """Matmul FLOPs of one step of the layer (2*m*n*k per product), dense attention:
    forward  base  2T(4C^2 + 3CF)                  q,k,v,o (C x C), gate, up (F x C), down (C x F)
             LoRA  2T r (in + out) per projection   x A^T then t B^T
             attn  2 * 2 H T^2 D                    S = Q K^T, O = P V over the full T x T
    backward base  = forward base (dX only; the base weights are frozen)
             LoRA  2 x forward LoRA                 dB, dt, dA, dX
             attn  2 x forward attn                 dV, dP, dQ, dK
    Elementwise work (norms, RoPE, softmax, SwiGLU) and the LM head are not counted.
    With T=512, C=2048, F=5632, H=16, D=128, r=32: 115.54 GFLOP (52.61 + 1.29 + 2.15 forward).
    KV (GQA) shrinks k and v to KV*D outputs; by default KV = H."""
    kvd = (H if KV is None else KV) * D
    shapes = [(H * D, C), (kvd, C), (kvd, C), (C, H * D), (F, C), (F, C), (C, F)]  # (out, in)
    base = sum(2 * T * o * i for o, i in shapes)
    lora = sum(2 * T * R * (o + i) for o, i in shapes)
    attn = 2 * 2 * H * T * T * D
    return 2 * base + 3 * lora + 3 * attn


FLOPS = w2_flops()


def activation_bytes(T=T, C=C, F=F, H=H, R=R, elt=4):
    """What one layer must keep from forward for backward (f32, B=1), as krnl keeps it:
        x (layer input, for RMSNorm backward)          T*C   + rstd1 T
        xn = rmsnorm(x) (input of q, k, v: dA)         T*C
        q, k after RoPE, v (per head)                  3*T*C
        P = softmax(S), dense                          H*T*T
        att (input of o_proj)                          T*C
        h = x + attn (for RMSNorm backward)            T*C   + rstd2 T
        hn = rmsnorm(h) (input of gate, up)            T*C
        g, u (for SwiGLU backward)                     2*T*F
        a = silu(g)*u (input of down)                  T*F
        t = x A^T of the 7 adapters                    7*T*r
    = elt * (T*(7C + 3F + 7r + 2) + H*T^2) = 81.2 MB at W2."""
    return elt * (T * (7 * C + 3 * F + 7 * R + 2) + H * T * T)


def step_temporaries_bytes(T=T, C=C, F=F, H=H, R=R, elt=4):
    """Every buffer krnl's forward_backward allocates in one step (model.py, one layer, V=256):
    28 T*C (13 forward + final norm, dlogits-to-x, head dX + 12 backward), 6 T*F (g, u, a, da,
    dg, du), 4 H*T^2 (S, P, dP, dS), 14 T*r (t and dt of 7 adapters), T*V logits, 4 T rows.
    On an asynchronous device a buffer released in a step is reused only after the step
    completes (docs/architecture.md, 'Memory'), so this (255.2 MB at W2) bounds what the pool reserves for one
    step there; the CPU reuses released buffers within the step and reserves about the live peak."""
    return elt * (28 * T * C + 6 * T * F + 4 * H * T * T + 14 * T * R + T * V + 4 * T)


def frozen_weight_bytes(C=C, F=F, elt=4):
    """The layer's frozen projections: 4 C^2 + 3 C F floats = 205.5 MB at W2 (norms not counted)."""
    return elt * (4 * C * C + 3 * C * F)


def _config(C, F, H, D, T, KV=None, eps=EPS):
    return ModelConfig.from_dict({
        "model_type": "llama", "vocab_size": V, "hidden_size": C, "intermediate_size": F,
        "num_hidden_layers": 1, "num_attention_heads": H, "num_key_value_heads": H if KV is None else KV,
        "head_dim": D, "rms_norm_eps": eps, "max_position_embeddings": max(T, 64), "tie_word_embeddings": False})


def _lora_values(cfg, r, seed):
    """A ~ U(+-1/sqrt(in)) as PEFT; B nonzero (PEFT starts it at 0) so every gradient path counts."""
    rng = np.random.default_rng(seed)
    vals = {}
    for m in ALL_MODULES:
        out, inp = cfg.module_shape(m)
        b = 1.0 / math.sqrt(inp)
        vals[lora_key(0, m, "A")] = rng.uniform(-b, b, (r, inp)).astype(np.float32)
        vals[lora_key(0, m, "B")] = (0.1 * rng.standard_normal((out, r)) / math.sqrt(r)).astype(np.float32)
    return vals


class Case:
    """One problem: weights, LoRA factors, ids and targets as numpy; krnl's model (on `device`, in
    `dtype`) and its step."""

    def __init__(self, C, F, H, D, T, r, seed=0, KV=None, eps=EPS, device="cpu", dtype="f32"):
        self.cfg = _config(C, F, H, D, T, KV, eps)
        self.T, self.r, self.eps, self.scale = T, r, eps, 2.0  # lora_alpha = 2r
        self.device, self.dtype = device, dtype
        self.flops = w2_flops(T, C, F, H, D, r, KV)
        self.weights = random_weights(self.cfg, seed=seed, std=0.02)
        self.lora = _lora_values(self.cfg, r, seed + 1)
        rng = np.random.default_rng(seed + 2)
        self.ids = rng.integers(0, V, (1, T)).astype(np.int32)
        self.targets = rng.integers(0, V, (1, T)).astype(np.int32)
        self.dev = krnl.device(device)
        self.model = LlamaModel(self.dev, self.cfg, self.weights, lora=LoraConfig(r=r, alpha=2.0 * r), dtype=dtype)
        self.model.input_grad = True  # the workload's dX
        self.model.lora_params.load(self.lora)

    @classmethod
    def of(cls, size, device="cpu", dtype="f32"):
        return cls(**size, device=device, dtype=dtype)

    def krnl_step(self):
        m = self.model
        with self.dev.step():
            m.zero_grads()
            m.forward_backward(self.ids, self.targets)
        self.dev.synchronize()

    def krnl_outputs(self):
        """(loss, grads, dx) of the step that ran last."""
        return (self.model.read_loss(), self.model.lora_grads(),
                np.array(self.model.d_embed_out.numpy(), np.float32).reshape(self.T, -1))

    def krnl_result(self):
        self.krnl_step()
        return self.krnl_outputs()


def _as_dict(loss, grads, dx):
    out = {"loss": np.float32(loss), "dx": np.asarray(dx, np.float32)}
    out.update({k: np.asarray(v, np.float32) for k, v in grads.items()})
    return out


def build_krnl(case):
    return case.krnl_step, lambda: _as_dict(*case.krnl_result())


def build_krnl_graph(case):
    """The step recorded once as a CUDA graph and replayed (Device.capture), as the Trainer's
    is: its inputs (ids, targets, positions, the loss's scale) uploaded before the recording,
    so a replay copies nothing from the host; the body opens no step of its own."""
    m, dev = case.model, case.dev
    ids = dev.tensor(case.ids, "i32")
    host = m.prepare(ids, case.targets)
    inputs = DeviceInputs.of(dev, host, ids.reshape(-1))

    def body():
        m.zero_grads()
        return m.forward_backward_mean(host, inputs)

    step, graph = replayed(dev, body)

    def result():
        step()
        loss, grads, dx = case.krnl_outputs()
        return _as_dict(float(np.asarray(graph.outputs.numpy(), np.float32).reshape(-1)[0]), grads, dx)

    return step, result


def _rope_tables(cfg, T):
    inv = cfg.inv_freq().astype(np.float64)
    fr = np.outer(np.arange(T, dtype=np.float64), inv)
    return (np.concatenate([np.cos(fr)] * 2, -1).astype(np.float32),
            np.concatenate([np.sin(fr)] * 2, -1).astype(np.float32))


def _weights_by_module(case):
    p = "model.layers.0."
    return {m: case.weights[p + ("self_attn." if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp.") + m + ".weight"]
            for m in ALL_MODULES}
