"""Tied input/output embeddings under PACI, without a collective in the steady state.

Stock Megatron keeps the first stage's word embedding and the last stage's output layer equal
by all-reducing their gradients over the embedding group at every step, after each stage's
data-parallel reduction (``finalize_model_grads``). Under PACI that would make the last stage
wait for the first at each local step. Instead, as actions of the lists (``schedule.py``):

* stage 0 owns the tied weight; only its optimizer moves it;
* SG: right after its R (the data-parallel reduction of group u) the last stage sends its
  output-layer gradient as that reduction left it: the whole gradient, or with the
  distributed optimizer this data-parallel rank's shard of it (Megatron puts the tied weight
  in a bucket of its own on both stages, so both shard it the same way). Under fp16 its loss
  scale follows in a tiny message. RG: stage 0 receives it before its R, which adds it to its
  own reduced gradient (rescaled to stage 0's loss scale, a power of two: exact) before the
  per-token division: the sum stock's all-reduce computes at that point, bit for bit;
* SW: stage 0 sends the weight it stepped to (its fp32 master copy, or its shard of it);
* RW: right after sending SG of group i the last stage posts the receive of stage 0's weight
  after step i, and installs it at its own step i + L, L = ``shape.tied_lag(P, a)`` =
  ceil(P/a): the smallest lag at which that message has been sent before the last stage
  needs it (stage 0 sends after step i, then runs forward (i+1)a-1+P, which the last stage's
  step i + L waits for through the pipeline). The install goes into the master copy right
  after the inner optimizer's update (a step post-hook), so Megatron's own copy to the model
  weight (and the distributed optimizer's all-gather) spreads it: both stages' model weights
  are the same cast of the same fp32 values. A skipped step installs after it, the same way
  by hand. Before step L the last stage keeps the stream's starting value (its own
  optimizer's move is undone). Both copies therefore run through the same values, the last
  stage's L steps late. Both ends meet a group's messages in the same order (SG, then the
  weight), so one communicator serves both directions without either send waiting behind the
  other's receive, and every receive is posted before its send;
* a drain (and an evaluation without drain, temporarily) brings the last stage's copy up to
  date: stage 0 already sent every version, the last stage only receives.

Buffers, each allocated once per stream and reused: stage 0 one for the weight in flight (its
previous send is done by its next SW: the receive was posted right after that group's SG) and
one for the gradient received; the last stage the L + 1 weights received and not installed,
and at most L gradients in flight: the send of group u is freed once it reports done (on NCCL
when stage 0's RG ran), at the latest at SG u + L, where it is known received by the argument
for L above. Waiting for it earlier (at the next SG) would stall behind stage 0 whenever
P > a: the timed lists put stage 0's RG u after the last stage's SG u + 1 at P=4, a=1 and
at P=8, a=1 and 2, for instance (forward 1, backward 2).

Staleness of the tied weight: a last-stage forward of group g uses owner version
``max(0, g - L)`` and its gradient is applied by stage 0's step g, so it is at most L steps
stale, measured per micro-batch and checked like the stage drift.

The messages go over Megatron's embedding group (first and last stage of one tensor/data
coordinate), point to point; no rank ever waits for one that was not already sent.

Multi-token prediction at P > 1 shares a weight the same way: its layers on the last stage
read a copy of stage 0's word embedding, which Megatron zeroes at start, all-reduces from stage
0, and keeps equal by the same gradient all-reduce. So "the tied weight" is whatever
``shared_embedding_or_output_weight()`` returns on stage 0 and the last stage whenever
``shares_first_and_last`` holds: the output layer (tied embeddings), or the MTP stage's copy of
the embedding (tied or not; tied, the output layer reads that copy too).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections import Counter, deque
from typing import Any, Callable, Deque, List, Optional, Tuple

import torch

from ..features.base import StageContext, StageFeature, sub_optimizers
from ..shape import tied_lag


def _inner(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def shares_first_and_last(model) -> bool:
    """Does stage 0 share a weight with the last stage? Tied embeddings (the output layer is
    the word embedding) or multi-token prediction (its layers on the last stage read a copy
    of the word embedding): Megatron all-reduces that copy's gradient with stage 0's at every
    step in both cases (``finalize_model_grads``), and PACI replaces that with the tied
    actions. The one model-side test; every stage answers alike (the lists agree). The flags'
    side is ``config.first_stage_shares_weight``."""
    inner = _inner(model)
    config = getattr(inner, "config", None)
    return bool(getattr(inner, "share_embeddings_and_output_weights", False)
                or getattr(config, "mtp_num_layers", None))


def shared_weight(model) -> Optional[torch.nn.Parameter]:
    """The stage's copy of the shared weight (stage 0's word embedding; on the last stage the
    output layer, or with MTP its copy of the embedding: Megatron's
    ``shared_embedding_or_output_weight``), or None when nothing is shared or the stage holds
    neither."""
    inner = _inner(model)
    if not shares_first_and_last(inner):
        return None
    if not (getattr(inner, "pre_process", False) or getattr(inner, "post_process", False)):
        return None
    return inner.shared_embedding_or_output_weight()


def stepped_part(optimizer, param) -> Tuple[Any, Optional[torch.Tensor], int, int]:
    """What the optimizer steps of ``param`` on this rank: (sub-optimizer, tensor, lo, hi),
    the tensor holding ``param.view(-1)[lo:hi]``: its fp32 master copy under bf16/fp16, with
    the distributed optimizer this data-parallel rank's shard of it (tensor None, lo = hi,
    where the rank holds no part), else ``param`` itself."""
    numel = param.numel()
    for opt in sub_optimizers(optimizer):
        if param in getattr(opt, "model_param_gbuf_map", {}):  # the distributed optimizer
            groups = zip(opt.model_float16_groups + opt.model_fp32_groups,
                         opt.shard_fp32_from_float16_groups + opt.shard_fp32_groups)
            for models, shards in groups:
                for model_param, shard in zip(models, shards):
                    if model_param is param:
                        span = opt._get_model_param_range_map(param)["param"]
                        return opt, shard, span.start, span.end
            return opt, None, 0, 0
        for models, mains in zip(getattr(opt, "float16_groups", []),
                                 getattr(opt, "fp32_from_float16_groups", [])):
            for model_param, main in zip(models, mains):
                if model_param is param:
                    return opt, main, 0, numel
    owner = next((opt for opt in sub_optimizers(optimizer)
                  if any(p is param for g in opt.optimizer.param_groups for p in g["params"])),
                 None)
    return owner, param, 0, numel


def main_param(optimizer, param) -> torch.Tensor:
    """The tensor the optimizer steps for ``param`` (see ``stepped_part``; an empty one where
    a distributed optimizer's rank holds no part of it)."""
    _opt, main, _lo, _hi = stepped_part(optimizer, param)
    return main if main is not None else param.detach().view(-1)[:0]


def install(param, main, value: torch.Tensor) -> None:
    """Set the master copy and the model weight to ``value`` (the model weight as Megatron
    derives it from the master copy, so both stages' bf16 copies agree bit for bit); whole
    tensors, no distributed optimizer."""
    with torch.no_grad():
        if main is not param:
            main.copy_(value)
            param.data.copy_(main)
        else:
            param.data.copy_(value)


def optimizer_state(optimizer, main) -> dict:
    """The optimizer's state of the tensor it steps for the tied weight ({} before a step)."""
    for opt in sub_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is not None and main is not None and main in inner.state:
            return inner.state[main]
    return {}


def grad_of(param) -> torch.Tensor:
    return param.main_grad if getattr(param, "main_grad", None) is not None else param.grad


class TiedCopy:
    """One stage's copy of the tied weight as its optimizer steps it: the gradient span and
    master tensor of this rank, and how the model weight follows the master copy."""

    def __init__(self, model, optimizer):
        self.weight = shared_weight(model)
        self.opt, self.main, self.lo, self.hi = stepped_part(optimizer, self.weight)
        self.sharded = self.weight in getattr(self.opt, "model_param_gbuf_map", {})
        self.bucket_group = model.param_to_bucket_group[self.weight] if self.sharded else None
        if self.sharded and any(len(b.params) != 1 for b in self.bucket_group.buckets
                                if self.weight in b.params):
            # both stages must cut the weight into the same shards: Megatron-Core splits a
            # "shared_embedding" parameter into a bucket of its own for that
            raise RuntimeError("the tied weight shares a distributed-optimizer bucket with "
                               "other parameters; its shards would differ between stage 0 "
                               "and the last stage")

    @property
    def empty(self) -> bool:
        return self.hi == self.lo

    def grad(self) -> torch.Tensor:
        """The part of the gradient this rank's optimizer steps on (after its reduction)."""
        return grad_of(self.weight).view(-1)[self.lo:self.hi]

    def master(self) -> Optional[torch.Tensor]:
        """The master copy of this rank's span, flat (None: no part on this rank)."""
        return None if self.main is None else self.main.detach().view(-1)

    def set_master(self, value: torch.Tensor) -> None:
        if self.main is not None:
            self.main.data.view(-1).copy_(value.view(-1))

    def follow_master(self) -> None:
        """The model weight from the master copy, as Megatron's step derives it (the
        distributed optimizer: this rank's shard of the parameter buffer, then the
        all-gather that brings in the others; every data-parallel rank of the stage takes
        this path together)."""
        if not self.sharded:
            if self.main is not self.weight:
                self.weight.data.copy_(self.main)
            return
        if self.main is not None:
            self.weight.data.view(-1)[self.lo:self.hi].copy_(self.main)
        self._gather()

    def show(self, value: torch.Tensor) -> None:
        """The model weight only (an evaluation reads stage 0's current weight)."""
        if not self.sharded:
            self.weight.data.copy_(value.view(self.weight.shape))
            return
        if not self.empty:
            self.weight.data.view(-1)[self.lo:self.hi].copy_(value)
        self._gather()

    def whole(self) -> None:
        """The distributed optimizer: every shard of the model weight in (the all-gather of
        a step is left to the next forward with --overlap-param-gather)."""
        if self.sharded:
            self._gather()

    def _gather(self) -> None:
        """The all-gather of the tied weight's bucket group, synchronous; one still in flight
        is finished first (it may have read the shard before it was written)."""
        group = self.bucket_group
        if group.param_gather_handle is not None:
            group.param_gather_handle.wait()
            group.param_gather_handle = None
        group.start_param_sync(force_sync=True)


class TiedStalenessExceeded(RuntimeError):
    pass


def _isend(tensor: torch.Tensor, peer: int, group):
    return torch.distributed.isend(tensor, dst=peer, group=group) if tensor.numel() else None


def _irecv(tensor: torch.Tensor, peer: int, group):
    return torch.distributed.irecv(tensor, src=peer, group=group) if tensor.numel() else None


def _completed(works: list) -> bool:
    return all(work is None or work.is_completed() for work in works)


def _wait(works: list) -> None:
    """Each posted message waited for once (gloo's wait is not idempotent: a second wait on
    the same receive waits for another message)."""
    for i, work in enumerate(works):
        if work is not None:
            work.wait()
            works[i] = None


class TiedEmbedding(StageFeature):
    """One stage's half of the tied-weight exchange for one PACI stream (from an empty or
    drained pipeline on; micro-batch and step numbers count from there). ``loss_scale``
    (fp16): this stage's current scale, which its gradients are expressed in."""

    name = "tied"

    def __init__(self, *, model, optimizer, stage: int, num_stages: int, accumulation: int,
                 group, histogram: Counter, bound: Optional[int] = None,
                 loss_scale: Optional[Callable[[], float]] = None):
        self.copy = TiedCopy(model, optimizer)
        self.weight = self.copy.weight
        self.optimizer = optimizer
        self.is_owner = stage == 0
        self.accumulation = accumulation
        self.lag = tied_lag(num_stages, accumulation)
        self.bound = self.lag if bound is None else bound
        self.group = group
        self.loss_scale = loss_scale
        me = torch.distributed.get_rank()
        others = [r for r in torch.distributed.get_process_group_ranks(group) if r != me]
        if len(others) != 1:
            raise RuntimeError(f"the embedding group should pair this rank with one other "
                               f"stage, it holds {sorted(others + [me])}")
        self.peer = others[0]
        self.steps = 0  # local steps of this stream
        # last stage: gradients sent, [step index, works, buffer], oldest first; the one R
        # took for the next SG; receives of stage 0's weights posted (RW), not installed,
        # [works, weight]; free buffers; the value its next step installs, and whether the
        # step did
        self.grad_sends: Deque[list] = deque()
        self.outgoing: Optional[list] = None
        self.inbox: Deque[list] = deque()
        self.spare: List[torch.Tensor] = []
        self.due: Optional[list] = None
        self.placed = False
        self.installed = 0  # owner version the last stage's copy holds
        # stage 0: the last stage's gradient received (RG) and its scale; the weight in flight
        self.incoming: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        self.weight_send: Optional[list] = None
        self.histogram = histogram  # kept by the runtime across streams

    def _buffer(self, dtype) -> torch.Tensor:
        if self.spare:
            return self.spare.pop()
        return torch.empty(self.copy.hi - self.copy.lo, dtype=dtype, device=self.weight.device)

    def _scale_tensor(self) -> torch.Tensor:
        """This stage's loss scale as a new one-element float64 tensor on the device (the
        scale itself stays there: never read back by the host)."""
        scale = self.loss_scale() if self.loss_scale else None
        if scale is None:
            return torch.ones(1, dtype=torch.float64, device=self.weight.device)
        if torch.is_tensor(scale):
            return scale.detach().reshape(1).to(torch.float64, copy=True)
        return torch.tensor([float(scale)], dtype=torch.float64, device=self.weight.device)

    # last stage ------------------------------------------------------------------------------
    def before_forward(self, ctx: StageContext, mb: int) -> None:
        """Staleness of this micro-batch's use of the tied weight: stage 0 applies its
        gradient at step mb // a; the copy used holds owner version ``installed``."""
        if self.is_owner:
            return
        stale = mb // self.accumulation - self.installed
        if stale > self.bound:
            raise TiedStalenessExceeded(
                f"PACI tied-embedding staleness bound violated: micro-batch {mb} used owner "
                f"version {self.installed}, its gradient is applied at owner step "
                f"{mb // self.accumulation} (staleness {stale} > {self.bound})")
        self.histogram[stale] += 1

    def after_reduction(self, ctx: StageContext) -> None:
        """In R right after the data-parallel reduction, where stock's all-reduce sums the
        two halves (before the per-token division): stage 0 adds the last stage's half;
        the last stage keeps its own for SG."""
        if self.is_owner:
            self._add_received_half()
        else:
            self._keep_own_half()

    def _add_received_half(self) -> None:
        """The last stage's half joins stage 0's gradient at this stage's loss scale."""
        buf, scale = self.incoming
        if self.loss_scale is not None:  # on the device: a power of two, exact
            buf.mul_((self._scale_tensor() / scale).to(buf.dtype))
        self.copy.grad().add_(buf)

    def _keep_own_half(self) -> None:
        """The output layer's gradient, kept for SG in the buffer of a send that is done: one
        that reports so (NCCL does once stage 0's receive ran; gloo only once waited for), or
        one known to be received (group ``steps - L`` or older: see the module docstring),
        whose wait cannot stall."""
        buf = None
        while self.grad_sends and (self.grad_sends[0][0] <= self.steps - self.lag
                                   or _completed(self.grad_sends[0][1])):
            _index, works, buf, _scale = self.grad_sends.popleft()
            _wait(works)
        grad = self.copy.grad()
        if buf is None:
            buf = torch.empty_like(grad)
        buf.copy_(grad)
        self.outgoing = [self.steps, [], buf, None]

    def send_output_grad(self) -> None:
        """SG, right after R: the gradient R kept (and, fp16, the scale it is expressed in)."""
        entry, self.outgoing = self.outgoing, None
        entry[1].append(_isend(entry[2], self.peer, self.group))
        if self.loss_scale is not None and not self.copy.empty:
            entry[3] = self._scale_tensor()  # alive until waited for
            entry[1].append(_isend(entry[3], self.peer, self.group))
        self.grad_sends.append(entry)

    def install_weight(self, owner_mb: int) -> None:
        """RW: post the receive of stage 0's weight after its step closing ``owner_mb``; the
        step ``L`` later installs it."""
        master = self.copy.master()
        weight = self._buffer(torch.float32 if master is None else master.dtype)
        self.inbox.append([[_irecv(weight, self.peer, self.group)], weight])

    def before_step(self, ctx: StageContext) -> None:
        """What this step leaves in the last stage's copy: for the first L steps of a stream
        its starting value, then stage 0's weight after step ``steps - L`` (the oldest RW)."""
        if self.is_owner:
            return
        if self.steps < self.lag:
            master = self.copy.master()
            self.due = [[], master.detach().clone() if master is not None else None]
        else:
            self.due = self.inbox[0]
        self.placed = False

    def around_optimizer(self, ctx: StageContext):
        """Last stage: the due value goes into the master copy right after the inner
        optimizer's update, before Megatron derives the model weight from it."""
        if self.is_owner or self.copy.opt is None:
            return contextlib.nullcontext()
        return self._installing_in_step()

    @contextlib.contextmanager
    def _installing_in_step(self):
        def place(*_args) -> None:
            _wait(self.due[0])
            if self.due[1] is not None:
                self.copy.set_master(self.due[1])
            self.placed = True

        handle = self.copy.opt.optimizer.register_step_post_hook(place)
        try:
            yield
        finally:
            handle.remove()

    def after_step(self, ctx: StageContext, record) -> None:
        """Last stage: a step that did not update (skipped) installs here, by hand; the
        buffer of an installed weight is free again."""
        if self.is_owner:
            return
        if not self.placed:
            _wait(self.due[0])
            if self.due[1] is not None:
                self.copy.set_master(self.due[1])
            self.copy.follow_master()
        if self.steps >= self.lag:
            self.spare.append(self.inbox.popleft()[1])
            self.installed = self.steps - self.lag + 1
        self.due = None
        self.steps += 1

    def _received(self) -> Optional[torch.Tensor]:
        """Every weight posted for is in (stage 0 sent them all before this call ended); the
        newest, or None when none is pending."""
        for works, _weight in self.inbox:
            _wait(works)
        return self.inbox[-1][1] if self.inbox else None

    # stage 0 ---------------------------------------------------------------------------------
    def receive_output_grad(self) -> None:
        """RG, before stage 0's R: the last stage's gradient of the same group (sent before
        stage 0's closing backward could run) and, fp16, its scale."""
        buf = self.incoming[0] if self.incoming is not None else torch.empty_like(
            self.copy.grad())
        scale = self._scale_tensor()
        works = [_irecv(buf, self.peer, self.group)]
        if self.loss_scale is not None and not self.copy.empty:
            works.append(_irecv(scale, self.peer, self.group))
        _wait(works)
        self.incoming = (buf, scale)

    def send_weight(self) -> None:
        """SW, after stage 0's step: the stepped weight (its master copy, or its shard) to
        the last stage, from the one buffer: the previous send is done (the last stage posted
        its receive right after that group's SG, which this stage has received)."""
        if self.weight_send is not None:
            _wait(self.weight_send[0])
        master = self.copy.master()
        if self.weight_send is None:
            self.weight_send = [[], master.detach().clone() if master is not None
                                else torch.empty(0, device=self.weight.device)]
        else:
            self.weight_send[1].copy_(master)  # flat, both
        self.weight_send[0] = [_isend(self.weight_send[1], self.peer, self.group)]
        self.steps += 1

    # both ------------------------------------------------------------------------------------
    def _wait_sends(self) -> None:
        """Every message this stream sent is delivered (a drain)."""
        for _index, works, _buf, _scale in self.grad_sends:
            _wait(works)
        self.grad_sends.clear()
        if self.weight_send is not None:
            _wait(self.weight_send[0])

    def latest_for_eval(self) -> Optional[torch.Tensor]:
        """Last stage, between two calls: stage 0's current weight (already sent), kept in the
        inbox for the steps that will install it; None when the copy is current."""
        if self.is_owner:
            return None
        newest = self._received()
        return newest if self.installed < self.steps else None

    @contextlib.contextmanager
    def current_weight(self):
        """Evaluation without a drain: the last stage reads stage 0's current tied weight
        (already sent; kept for the steps that install it) and gets its lagging copy back."""
        latest = self.latest_for_eval()
        if latest is None:
            yield
            return
        self.copy.whole()  # what is put back must be the whole weight, every shard in
        lagging = self.weight.detach().clone()
        self.copy.show(latest)
        try:
            yield
        finally:
            with torch.no_grad():
                self.weight.data.copy_(lagging)

    def on_drain(self, ctx: StageContext) -> None:
        """Both copies equal again: the last stage installs stage 0's newest weight and takes
        its optimizer state of the tied weight; every message of this stream is delivered."""
        if not self.is_owner:
            latest = self.latest_for_eval()
            if latest is not None:
                self.copy.set_master(latest)
                self.copy.follow_master()
                self.installed = self.steps
            self.inbox.clear()
        self._wait_sends()
        self._share_optimizer_state()

    def _share_optimizer_state(self) -> None:
        """Under PACI the last stage's own moves of the tied weight are undone, so its optimizer
        state of that weight (Adam's moments) never counts, and drifts from stage 0's. Stock
        1F1B after a drain (a cool-down, a switch) steps both copies on the same gradient: they
        stay equal only with equal states, as a checkpoint load would give (it stores stage
        0's). Stage 0 sends its state's tensors (its shard's, with the distributed optimizer),
        in the order of their names, once both sides agree on their number (a stage that
        skipped its first steps has none yet)."""
        state = optimizer_state(self.optimizer, self.copy.main)  # the key: the tensor itself
        # the moments; the step count stays the stage's own (one for all its weights: the
        # distributed optimizer's state_dict asserts it, and fp16 stages skip apart)
        names = [name for name in sorted(state) if torch.is_tensor(state[name])
                 and name != "step"]
        count = torch.tensor([len(names)], dtype=torch.int64, device=self.weight.device)
        if self.is_owner:
            torch.distributed.send(count, dst=self.peer, group=self.group)
            torch.distributed.recv(count, src=self.peer, group=self.group)
        else:
            theirs = torch.empty_like(count)
            torch.distributed.recv(theirs, src=self.peer, group=self.group)
            count = torch.where(theirs == count, count, torch.zeros_like(count))
            torch.distributed.send(count, dst=self.peer, group=self.group)
        if int(count) != len(names):
            return
        for name in names:
            value = state[name]
            if self.is_owner:
                torch.distributed.send(value.detach().contiguous(), dst=self.peer, group=self.group)
            else:
                buf = torch.empty_like(value)
                torch.distributed.recv(buf, src=self.peer, group=self.group)
                with torch.no_grad():
                    value.copy_(buf)


def tied_sha256(model, optimizer) -> Optional[str]:
    """SHA-256 of this stage's copy of the tied weight and of its optimizer's master copy
    (this rank's shard with the distributed optimizer; None on a stage that holds neither):
    equal digests on stage 0 and the last stage mean bit-identical copies."""
    weight = shared_weight(model)
    if weight is None:
        return None
    digest = hashlib.sha256()
    for tensor in (weight, main_param(optimizer, weight)):
        digest.update(tensor.detach().float().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()
