"""Tied input/output embeddings under PACI, without a collective in the steady state.

Stock Megatron keeps the first stage's word embedding and the last stage's output layer equal
by all-reducing their gradients over the embedding group at every step. Under PACI that would
make the last stage wait for the first at each local step. Instead, as actions of the lists
(``schedule.py``):

* stage 0 owns the tied weight; only its optimizer moves it;
* SG: the last stage sends its output-layer gradient of micro-batch group u (not yet reduced
  over data parallel) right after the backward that closes u; RG: stage 0 adds it to its own
  before its R (the data-parallel reduction), so stage 0 steps on the sum stock's all-reduce
  computes; SW: stage 0 sends the weight it stepped to;
* RW: right after sending SG of group i the last stage posts the receive of stage 0's weight
  after step i, and installs it after its own step i + L, L = ``shape.tied_lag(P, a)`` =
  ceil(P/a): the smallest lag at which that message has been sent before the last stage
  needs it (stage 0 sends after step i, then runs forward (i+1)a-1+P, which the last stage's
  step i + L waits for through the pipeline). Before that the last stage keeps its copy where
  it was (its own optimizer's move is undone). Both copies therefore run through the same
  values, the last stage's L steps late. Both ends meet a group's two messages in the same
  order (SG, then the weight), so one communicator serves both directions without either
  send waiting behind the other's receive, and every receive is posted before its send: a
  send completes as soon as it is posted (stage 0 keeps one copy in flight), the last stage
  holds the L + 1 weights it received and has not installed;
* a drain (and an evaluation without drain, temporarily) brings the last stage's copy up to
  date: stage 0 already sent every version, the last stage only receives.

Staleness of the tied weight: a last-stage forward of group g uses owner version
``max(0, g - L)`` and its gradient is applied by stage 0's step g, so it is at most L steps
stale, measured per micro-batch and checked like the stage drift.

The messages go over Megatron's embedding group (first and last stage of one tensor/data
coordinate), point to point; no rank ever waits for one that was not already sent.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections import Counter, deque
from typing import Any, Deque, List, Optional, Tuple

import torch

from ..features.base import StageContext, StageFeature
from ..shape import tied_lag


def shared_weight(model) -> Optional[torch.nn.Parameter]:
    """The stage's copy of the tied weight (embedding on stage 0, output layer on the last
    stage), or None when the model is untied or the stage holds neither."""
    inner = model
    while hasattr(inner, "module"):
        inner = inner.module
    if not getattr(inner, "share_embeddings_and_output_weights", False):
        return None
    if not (getattr(inner, "pre_process", False) or getattr(inner, "post_process", False)):
        return None
    return inner.shared_embedding_or_output_weight()


def main_param(optimizer, param) -> torch.Tensor:
    """The tensor the optimizer steps for ``param``: its fp32 master copy under bf16, else
    ``param`` itself."""
    for opt in list(getattr(optimizer, "chained_optimizers", None) or [optimizer]):
        for models, mains in zip(getattr(opt, "float16_groups", []),
                                 getattr(opt, "fp32_from_float16_groups", [])):
            for model_param, main in zip(models, mains):
                if model_param is param:
                    return main
    return param


def install(param, main, value: torch.Tensor) -> None:
    """Set the master copy and the model weight to ``value`` (the model weight as Megatron
    derives it from the master copy, so both stages' bf16 copies agree bit for bit)."""
    with torch.no_grad():
        if main is not param:
            main.copy_(value)
            param.data.copy_(main)
        else:
            param.data.copy_(value)


def optimizer_state(optimizer, main) -> dict:
    """The optimizer's state of the tensor it steps for the tied weight ({} before a step)."""
    for opt in list(getattr(optimizer, "chained_optimizers", None) or [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is not None and main in inner.state:
            return inner.state[main]
    return {}


def grad_of(param) -> torch.Tensor:
    return param.main_grad if getattr(param, "main_grad", None) is not None else param.grad


class TiedStalenessExceeded(RuntimeError):
    pass


class TiedEmbedding(StageFeature):
    """One stage's half of the tied-weight exchange for one PACI stream (from an empty or
    drained pipeline on; micro-batch and step numbers count from there)."""

    name = "tied"

    def __init__(self, *, model, optimizer, stage: int, num_stages: int, accumulation: int,
                 group, histogram: Counter, bound: Optional[int] = None):
        self.weight = shared_weight(model)
        self.main = main_param(optimizer, self.weight)
        self.optimizer = optimizer
        self.is_owner = stage == 0
        self.accumulation = accumulation
        self.lag = tied_lag(num_stages, accumulation)
        self.bound = self.lag if bound is None else bound
        self.group = group
        me = torch.distributed.get_rank()
        others = [r for r in torch.distributed.get_process_group_ranks(group) if r != me]
        if len(others) != 1:
            raise RuntimeError(f"the embedding group should pair this rank with one other "
                               f"stage, it holds {sorted(others + [me])}")
        self.peer = others[0]
        self.steps = 0  # local steps of this stream
        self.sends: List[Tuple[int, Any, torch.Tensor]] = []  # (step index, work, tensor)
        # last stage: receives of stage 0's weights posted (RW), oldest first, not installed:
        # [work (None once waited), weight]
        self.inbox: Deque[list] = deque()
        self.installed = 0  # owner version the last stage's copy holds
        self.snapshot: Optional[torch.Tensor] = None
        self.histogram = histogram  # kept by the runtime across streams

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

    def send_output_grad(self) -> None:
        """SG, after the backward that closes a group: the output layer's gradient to stage 0."""
        grad = grad_of(self.weight).detach().clone()
        work = torch.distributed.isend(grad, dst=self.peer, group=self.group)
        self.sends.append((self.steps, work, grad))

    def before_step(self, ctx: StageContext) -> None:
        if not self.is_owner and self.steps < self.lag:
            self.snapshot = self.main.detach().clone()

    def after_step(self, ctx: StageContext, record) -> None:
        """Last stage: undo its own move of the tied weight; the first L steps of a stream
        keep the stream's starting value, step n >= L installs stage 0's weight after its
        step n - L (received by the oldest RW posted)."""
        if self.is_owner:
            return
        if self.steps < self.lag:
            install(self.weight, self.main, self.snapshot)
            self.snapshot = None
        else:
            install(self.weight, self.main, self._wait(self.inbox.popleft()))
            self.installed = self.steps - self.lag + 1
        self.steps += 1
        # stage 0 received gradient u at its step u, which precedes this step if u <= steps-1-L
        self._wait_sends(self.steps - 1 - self.lag)

    def install_weight(self, owner_mb: int) -> None:
        """RW: post the receive of stage 0's weight after its step closing ``owner_mb``;
        ``after_step`` L steps later installs it."""
        weight = torch.empty_like(self.main)
        self.inbox.append([torch.distributed.irecv(weight, src=self.peer, group=self.group),
                           weight])

    @staticmethod
    def _wait(entry: list) -> torch.Tensor:
        """A posted receive's weight, waited for once (gloo's wait is not idempotent: a
        second wait on the same receive waits for another message)."""
        if entry[0] is not None:
            entry[0].wait()
            entry[0] = None
        return entry[1]

    def _received(self) -> Optional[torch.Tensor]:
        """Every weight posted for is in (stage 0 sent them all before this call ended); the
        newest, or None when none is pending."""
        for entry in self.inbox:
            self._wait(entry)
        return self.inbox[-1][1] if self.inbox else None

    # stage 0 ---------------------------------------------------------------------------------
    def add_output_grad(self, factor: float = 1.0) -> None:
        """RG, before stage 0's data-parallel reduction: add the last stage's gradient of the
        same group (sent before stage 0's closing backward could run), times ``factor``."""
        grad = grad_of(self.weight)
        buf = torch.empty_like(grad)
        torch.distributed.irecv(buf, src=self.peer, group=self.group).wait()
        if torch.is_tensor(factor) or factor != 1.0:  # a device tensor: never compared here
            buf.mul_(factor)
        grad.add_(buf)

    def send_weight(self) -> None:
        """SW, after stage 0's step: the stepped weight (its master copy) to the last stage."""
        value = self.main.detach().clone()
        work = torch.distributed.isend(value, dst=self.peer, group=self.group)
        self.sends.append((self.steps, work, value))
        self.steps += 1
        # the last stage posted the receive of weight i before stage 0's step i (right after
        # its SG i): the previous weight's send is done by now, one copy stays in flight
        self._wait_sends(self.steps - 2)

    # both ------------------------------------------------------------------------------------
    def _wait_sends(self, upto: int) -> None:
        keep = []
        for index, work, tensor in self.sends:
            if index <= upto:
                work.wait()
            else:
                keep.append((index, work, tensor))
        self.sends = keep

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
        lagging = self.weight.detach().clone()
        with torch.no_grad():
            self.weight.data.copy_(latest)
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
                install(self.weight, self.main, latest)
                self.installed = self.steps
            self.inbox.clear()
        self._wait_sends(self.steps)
        self._share_optimizer_state()

    def _share_optimizer_state(self) -> None:
        """Under PACI the last stage's own moves of the tied weight are undone, so its optimizer
        state of that weight (Adam's moments) never counts, and drifts from stage 0's. Stock
        1F1B after a drain (a cool-down, a switch) steps both copies on the same gradient: they
        stay equal only with equal states, as a checkpoint load would give (it stores stage
        0's). Stage 0 sends its state's tensors, in the order of their names, once both sides
        agree on their number (a stage that skipped its first steps has none yet)."""
        state = optimizer_state(self.optimizer, self.main)
        names = [name for name in sorted(state) if torch.is_tensor(state[name])]
        count = torch.tensor([len(names)], dtype=torch.int64, device=self.main.device)
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
    (None on a stage that holds neither): equal digests on stage 0 and the last stage mean
    bit-identical copies."""
    weight = shared_weight(model)
    if weight is None:
        return None
    digest = hashlib.sha256()
    for tensor in (weight, main_param(optimizer, weight)):
        digest.update(tensor.detach().float().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()
