"""One optimizer step on the device: its micro-batches padded to a length bucket, each run as
the model's device-side step (eager, or a recorded graph replayed), the optimizer's update, and
one host read at the end (the losses, the gradient norm, the inf/NaN flag).

Where the device replays graphs (Device.capabilities()["graphs"]), a micro-batch's step is
recorded once per key (batch shape, padded length, packing, dropout: HostInputs.key) and
replayed with new contents in its input tensors, and the optimizer's update once; the first
call of each key runs for real while it records (Device.capture's warm-up). The graphs share one
arena of temporaries (the device's graph arena), so memory stays that of the largest step, not
the sum of all keys'. A replayed step does exactly the eager step's work at the same padded
length; padding adds ignored tokens after each row's last one, which no real token attends to."""

import numpy as np

from .. import _core
from .batches import IGNORE_INDEX
from ..models.step_inputs import DeviceInputs

ops = _core.ops


def padded_length(T, bucket, max_positions, switch=None):
    """T rounded up to a multiple of `bucket`, never past max_positions (unless T is) nor across
    `switch` (LongRoPE's position where the rotary frequencies change for the whole call)."""
    if bucket <= 1:
        return T
    Tp = min(-(-T // bucket) * bucket, max(T, max_positions))
    if switch is not None and T <= switch < Tp:
        Tp = switch
    return Tp


def pad_batch_to(batch, T):
    """A batch tuple (ids, targets[, segments, positions]) of (B, t) arrays padded to (B, T):
    ids 0, targets ignored, padding in a segment of its own at position 0."""
    ids, tg = np.asarray(batch[0]), np.asarray(batch[1])
    if ids.ndim == 1:
        ids, tg = ids[None, :], tg[None, :]
        batch = (ids, tg) + tuple(np.asarray(a)[None, :] for a in batch[2:])
    extra = T - ids.shape[1]
    if extra <= 0:
        return batch
    pad = lambda a, v: np.concatenate([a, np.full((a.shape[0], extra), v, a.dtype)], axis=1)
    out = [pad(ids, 0), pad(tg, IGNORE_INDEX)]
    if len(batch) > 2:
        seg, pos = np.asarray(batch[2]), np.asarray(batch[3])
        last = seg.max(axis=1, keepdims=True) + 1
        out += [np.concatenate([seg, np.repeat(last, extra, axis=1).astype(seg.dtype)], axis=1), pad(pos, 0)]
    return tuple(out)


class StepRunner:
    """micro_batch() for each micro-batch, optimizer(), then finish(): the step's loss and the
    optimizer's info, after the one wait of the step."""

    def __init__(self, model, opt, bucket=1, replay=False, micro_batches=1, world=None, reducer=None, objective=None):
        self.model, self.opt, self.dev = model, opt, model.dev
        self.objective, self.metrics = objective, []  # a sequence objective (krnl.train.preference), its metrics
        self.world = world  # a krnl.train.dist.world.World of size > 1: the grads and losses are summed over its ranks
        # a krnl.train.dist.nccl.NcclReducer: that sum runs on the device (NCCL), before the update and in
        # its recorded graph, instead of through host memory
        self.reducer = reducer
        self.waiting_in = None  # what finish() waits for on the NCCL path, named for the watchdog
        self.reduced = None  # the micro-batches' loss sums over every rank, once optimizer() summed them
        self.host = None     # (numel + micro_batches,) f32: the host copy reduce() sums
        self.bucket, self.replay = int(bucket), bool(replay)
        c = model.config
        self.max_positions, self.switch = c.max_position_embeddings, c.rope_switch_position
        self.graphs = {}       # HostInputs.key() -> (Graph, DeviceInputs it reads)
        self.opt_graph = None
        self.hyper = self.dev.zeros((opt.hyper_size,), "f32") if self.replay else None
        self.slot = self.dev.zeros((1,), "f32")  # a replayed micro-batch's loss sum
        self.losses = self.dev.zeros((micro_batches,), "f32")  # each micro-batch's loss sum
        # a mixture's load-balancing loss of each micro-batch (this rank's rows), and a replay's
        self.aux = self.dev.zeros((micro_batches,), "f32") if model.router_stats else None
        self.aux_slot = self.dev.zeros((1,), "f32") if model.router_stats else None
        self.n_valid = []

    def pad(self, batch):
        T = np.asarray(batch[0]).shape[-1]
        return pad_batch_to(batch, padded_length(T, self.bucket, self.max_positions, self.switch))

    def micro_batch(self, batch, loss_scale, index, n_valid_total=None, first_row=None):
        """Queues micro-batch `index` of this step (0 first); returns its non-padding target count.
        n_valid_total: the target count of the whole micro-batch when `batch` is this rank's
        slice of it, so that the loss gradient's factor is loss_scale / n_valid_total and the sum
        of the ranks' gradients is the gradient of the whole micro-batch's mean loss; first_row:
        the slice's first row in it, so that its dropout masks are the whole batch's."""
        m, dev = self.model, self.dev
        if index == 0:
            self.n_valid, self.reduced, self.metrics = [], None, []
        if index >= self.losses.shape[0]:
            raise ValueError(f"[StepRunner] micro-batch {index} of a runner made for {self.losses.shape[0]}")
        if self.objective is not None:  # eager, two device steps (models/sequence_loss.py); its own batches
            loss, metrics, tokens = self.objective.run(m, batch, loss_scale)
            dev.upload(self.losses[index:index + 1], np.array([loss], np.float32))
            self.n_valid.append(1)
            self.metrics.append(metrics)
            return tokens
        batch = self.pad(batch)
        host = m.prepare(batch[0], batch[1], loss_scale, *batch[2:4])
        if n_valid_total is not None:
            host.ce_scale = float(loss_scale) / max(int(n_valid_total), 1)
        if first_row is not None:
            host.first_row = int(first_row) * host.T  # in token rows of (B T, C) activations
        self.n_valid.append(host.n_valid if n_valid_total is None else int(n_valid_total))
        out = self.losses[index:index + 1]
        key = host.key()
        if not self.replay:
            inputs = DeviceInputs.of(dev, host)
            with dev.step():  # one submission per micro-batch
                ops.cast(m.forward_backward_step(key, inputs), out)
                if self.aux is not None:
                    ops.cast(m.router_stats.last, self.aux[index:index + 1])
            return host.n_valid
        if key in self.graphs:
            graph, inputs = self.graphs[key]
            inputs.write(dev, host)
            graph.replay()
        else:
            inputs = DeviceInputs.of(dev, host)  # the graph's inputs from now on

            def body():
                ops.cast(m.forward_backward_step(key, inputs), self.slot)
                if self.aux is not None:
                    ops.cast(m.router_stats.last, self.aux_slot)

            self.graphs[key] = (dev.capture(body), inputs)  # its warm-up call is this micro-batch's run
        with dev.step():
            ops.cast(self.slot, out)
            if self.aux is not None:
                ops.cast(self.aux_slot, self.aux[index:index + 1])
        return host.n_valid

    def optimizer(self, n_micro, step=None):
        """Queues the optimizer's update over the grads of the n_micro micro-batches (summed over
        the world's ranks first: a wait for the device, then the host copy's allreduce). The
        model's sample-order slots (krnl.models.sample_sums) go into the grads first, eagerly."""
        if self.model.sums.on:
            with self.dev.step():
                self.model.sums.finish()
        on_device = self.reducer is not None
        if not (on_device and self.replay):
            self.reduce(step)
        if not self.replay:
            self.opt.queue_step(n_micro)
            return
        self.dev.upload(self.hyper, self.opt.hyper(n_micro))
        if self.opt_graph is None:  # the device's sum, where there is one, recorded with the update
            self.opt_graph = self.dev.capture(lambda: (self.reduce(step) if on_device else None,
                                                       self.opt.queue_ops(self.hyper)))
        else:
            self.waiting_in = f"the NCCL gradient allreduce of step {step}"
            self.opt_graph.replay()

    def reduce(self, step=None):
        """Sums the grads and this step's loss sums over the world's ranks (optimizer() does it
        first): one allreduce of their host copy, after a wait for the micro-batches; with a
        reducer, one NCCL allreduce in place on the device's stream, without waiting."""
        flat, k = self.model.lora_params, len(self.n_valid)
        n = flat.numel
        if self.reducer is not None:  # every micro-batch slot: a constant shape for the recording
            self.reducer.allreduce([flat.grads[:n], self.losses])
            self.waiting_in, self.reduced = f"the NCCL gradient allreduce of step {step}", None
            return
        if self.world is None or self.world.size == 1:
            return
        if self.host is None:  # kept: a fresh array of this size would be page-faulted in every step
            self.host = np.empty(n + self.losses.shape[0], np.float32)
        grads, host = flat.grads[:n], self.host[:n + k]
        host[:n] = grads.numpy()
        host[n:] = self.losses.numpy()[:k]
        self.world.allreduce(host, f"the gradient allreduce of step {step}", in_place=True)
        self.dev.upload(grads, host[:n])
        self.reduced = host[n:].copy()

    def finish(self):
        """(loss, info): the mean over micro-batches of each one's mean token loss, and
        AdamW.finish_step's info. The one wait of the step (besides the allreduce's)."""
        if self.reducer is not None:  # the wait covers the NCCL collective: a peer that stops hangs it
            info = self.reducer.wait(self.opt.finish_step, self.waiting_in or "the NCCL gradient allreduce")
        else:
            info = self.opt.finish_step()
        sums = self.reduced if self.reduced is not None else self.losses.numpy()
        sums = np.asarray(sums, np.float64)[:len(self.n_valid)]
        loss = float(np.mean([s / max(n, 1) for s, n in zip(sums, self.n_valid)]))
        if self.aux is not None:  # this rank's: the load-balancing loss is not summed over ranks
            info["aux_loss"] = float(np.mean(self.aux.numpy()[:len(self.n_valid)]))
        if self.metrics:  # the objective's, averaged over the micro-batches
            info["objective"] = sorted(self.metrics[0])
            info.update({k: float(np.mean([m[k] for m in self.metrics])) for k in self.metrics[0]})
        return loss, info

    def release(self):
        """Gives the recorded graphs' memory back."""
        for graph, _ in self.graphs.values():
            graph.release()
        if self.opt_graph is not None:
            self.opt_graph.release()
        self.graphs, self.opt_graph = {}, None
