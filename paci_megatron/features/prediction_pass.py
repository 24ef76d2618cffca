"""The weight prediction's arithmetic: one pass that writes each model weight as the optimizer
would step it, and one that puts it back. Torch only (``mcore/main_params.py`` lays Megatron's
state out for it).

A stage's state is moved in *pieces*: contiguous flat runs of the model weights (the target,
bf16 or fp16), their fp32 main copy, the optimizer's state (Adam's two moments, SGD's momentum)
and the gradient buffer, element for element aligned. Every element belongs to one *class* (a
param group of an optimizer, and whether its partial gradient may be folded in); the piece's
own class covers it, and the few elements of other classes (biases and norms without weight
decay, weights whose gradient is complete only later) are listed by index and moved by a
second, gathering kernel.

Two ways to run it, with the same formulas (``adam_value``, ``sgd_momentum_value``,
``sgd_value``, ``coefficients``):

* fused: each formula ``torch.compile``d (Triton on a GPU, C++ on a CPU): one kernel for the
  scalars, one per piece and per minor list, every scalar in small device tensors so nothing
  recompiles and nothing waits on the device; no temporaries;
* plain: the same formulas as eager torch ops over chunks of at most ``PLAIN_CHUNK`` elements
  (temporaries bounded by that), where ``torch.compile`` does not run.

Which one runs is decided once a run, at start-up (``Pass.settle``): every fused variant the
run will call is compiled there, on the stage's own tensors, and the stage's ranks agree (an
all-reduce of the flag: fused only where all of them compiled). After that nothing compiles
(a variant start-up did not meet runs plain, on that call), so a timed move holds no
compilation; and no fallback ever repeats the clipping norm's reduction, the pass's one
collective, which sits between two kernel calls.

The step's scalars that depend on the gradient are computed on the device before the move:
the norm of the estimated gradient, for the clipping, and whether it is finite. A non-finite
gradient means the next step will be skipped, so the prediction then aims one step fewer and
folds nothing, by elementwise selects: no host sync.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

import torch

# A class's coefficients. The host writes BLENDED of them twice, for a step that happens and
# for one that is skipped, and the device blends the two by the finite flag; CLIP and FACTOR
# are the host's too (the optimizer's --clip-grad, and a / k: what makes the buffer the mean
# of the group's k backwards so far); GRAD (the factor, unscaled and clipped) and FINITE are
# the device's.
KEEP, STEP, DECAY1, C1, DECAY2, C2, INV_SQRT_BC2, EPS, L2, NESTEROV = range(10)
BLENDED = 10
CLIP, FACTOR = 10, 11
HOST_COLUMNS = 12
GRAD, FINITE = 10, 11  # in the device coefficients, after the blended ones
COLUMNS = 12

PLAIN_CHUNK = 1 << 20  # elements per eager chunk: a few such fp32 temporaries at a time
KERNEL_ENV = "PACI_PREDICTION_KERNEL"  # fused | plain | auto (default)


@dataclass
class Klass:
    """One param group of one optimizer, as the prediction reads it: ``kind`` is "adam",
    "sgd_momentum" or "sgd"; ``fold``: whether the partial gradient may be folded in."""

    kind: str
    group: dict
    inner: object
    fold: bool = True
    decoupled: bool = True  # Adam: AdamW's decay (else L2: folded into the gradient)
    clip: float = 0.0  # the optimizer's --clip-grad (0: no clipping)


@dataclass
class Minor:
    """Elements of a piece that belong to another class than the piece's own."""

    index: torch.Tensor  # int64 offsets into the piece
    klass: int


@dataclass
class Piece:
    target: torch.Tensor  # the model weights (bf16/fp16), 1-D
    main: torch.Tensor  # fp32 main copy, 1-D
    state: Tuple[torch.Tensor, ...]  # adam: (exp_avg, exp_avg_sq); sgd_momentum: (buf,); sgd: ()
    grad: torch.Tensor  # the gradient buffer (the loss-scaled sum of the group so far), 1-D
    klass: int
    minors: Tuple[Minor, ...] = ()

    def numel(self) -> int:
        return self.main.numel()


# --- the formulas: eager chunks and compiled kernels share them ---------------------------

def _folded_grad(main, grad, c):
    """The clipped mean gradient estimate (plus L2 decay), zero where the step will skip (a
    select, not a product: the buffer may hold Inf or NaN)."""
    return torch.where(c[FINITE] > 0, torch.addcmul(grad.float() * c[GRAD], main, c[L2]), 0.0)


def adam_value(main, exp_avg, exp_avg_sq, grad, c):
    """Adam/AdamW d steps ahead: main x keep + step x m' / (sqrt(v') / sqrt(bc2) + eps) (step
    is negative), m' and v' the moments with the gradient folded in (``grad`` None: the
    moments alone)."""
    if grad is None:
        num, den = exp_avg, exp_avg_sq.sqrt()
    else:
        g = _folded_grad(main, grad, c)
        num = torch.addcmul(exp_avg * c[DECAY1], g, c[C1])
        den = torch.addcmul(exp_avg_sq * c[DECAY2], g, g * c[C2]).sqrt()
    return torch.addcdiv(main * c[KEEP], num * c[STEP], torch.addcmul(c[EPS], den, c[INV_SQRT_BC2]))


def sgd_momentum_value(main, buf, grad, c):
    """SGD with momentum (no dampening) d steps ahead: main + step x (buf', or g + mu buf'
    with Nesterov); without a gradient the buffer alone."""
    if grad is None:
        update = buf
    else:
        g = _folded_grad(main, grad, c)
        new = torch.addcmul(g, buf, c[DECAY1])
        update = torch.addcmul(new, torch.addcmul(g - new, new, c[C1]), c[NESTEROV])
    return torch.addcmul(main, update, c[STEP])


def sgd_value(main, grad, c):
    """SGD without momentum: main + step x (g + wd main); nothing moves where it skips."""
    return torch.addcmul(main, _folded_grad(main, grad, c), c[STEP])


def _value(kind: str, main, state, grad, c):
    if kind == "adam":
        return adam_value(main, state[0], state[1], grad, c)
    if kind == "sgd_momentum":
        return sgd_momentum_value(main, state[0], grad, c)
    return sgd_value(main, grad, c)


def coefficients(host, inv_scale, sumsq):
    """Every class's coefficients on the device ([classes, COLUMNS]) from the host rows
    ([classes, 2, HOST_COLUMNS]): the gradient's factor (a / k, times ``inv_scale``, the loss
    scale's inverse, or None for 1) clipped by the norm of the estimate (``sumsq``, its square;
    None: no gradient is folded, the step is taken as finite), the finite flag, and the host's
    two rows blended by it."""
    taken, skipped = host[:, 0, :BLENDED], host[:, 1, :BLENDED]
    clip, factor = host[:, 0, CLIP], host[:, 0, FACTOR]
    if inv_scale is not None:
        factor = factor * inv_scale
    if sumsq is None:
        finite = torch.ones_like(clip)
        grad = torch.zeros_like(clip)
    else:
        norm = sumsq.sqrt() * factor
        finite = torch.isfinite(norm).all().float().expand_as(clip)
        coeff = torch.where(clip > 0, (clip / (norm + 1.0e-6)).clamp(max=1.0), 1.0)
        grad = torch.where(finite > 0, coeff * factor, 0.0)
    blended = torch.addcmul(skipped, finite.unsqueeze(1), taken - skipped)
    return torch.cat([blended, grad.unsqueeze(1), finite.unsqueeze(1)], dim=1)


def grad_sumsq(grads: Sequence[torch.Tensor], excluded: Sequence[torch.Tensor]) -> torch.Tensor:
    """The squared norm of the stage's gradient buffers as Megatron's clipping norm counts
    them (``excluded``: the views of shared and tensor-parallel duplicate weights), [1]."""
    total = sum(torch.linalg.vector_norm(g, dtype=torch.float32).square() for g in grads)
    for grad in excluded:
        total = total - torch.linalg.vector_norm(grad, dtype=torch.float32).square()
    return total.clamp_min(0.0).view(1)


# --- the scalars ---------------------------------------------------------------------------

def host_coefficients(klass: Klass, lr_sums: Tuple[float, float], step: int,
                      factor: float = 0.0) -> List[List[float]]:
    """The class's coefficients for a step that happens (row 0) and one that is skipped
    (row 1): ``lr_sums`` are the sums of the LRs of the next d and d-1 steps, ``step`` the
    optimizer's step count so far (the next step's bias corrections), ``factor`` a / k."""
    group = klass.group
    rows = []
    for lrs, finite in ((lr_sums[0], 1.0), (lr_sums[1], 0.0)):
        row = [0.0] * HOST_COLUMNS
        row[EPS] = 1.0
        if klass.kind == "adam":
            beta1, beta2 = group["betas"]
            wd = group.get("weight_decay", 0.0)
            t = step + 1
            row[KEEP] = 1.0 - lrs * wd if klass.decoupled else 1.0
            row[STEP] = -lrs / (1.0 - beta1 ** t)
            row[DECAY1] = 1.0 - finite * (1.0 - beta1)
            row[C1] = 1.0 - beta1
            row[DECAY2] = 1.0 - finite * (1.0 - beta2)
            row[C2] = 1.0 - beta2
            row[INV_SQRT_BC2] = (1.0 - beta2 ** t) ** -0.5
            row[EPS] = group["eps"]
            row[L2] = 0.0 if klass.decoupled else wd
        else:
            momentum = group.get("momentum", 0.0)
            row[KEEP] = 1.0
            row[STEP] = -lrs
            row[DECAY1] = 1.0 - finite * (1.0 - momentum)
            row[C1] = momentum
            row[L2] = group.get("weight_decay", 0.0)
            row[NESTEROV] = 1.0 if group.get("nesterov") else 0.0
        row[CLIP] = klass.clip
        row[FACTOR] = factor
        rows.append(row)
    return rows


def scalars_to_device(rows: Sequence[Sequence[Sequence[float]]], device) -> torch.Tensor:
    """The host rows as a tensor on ``device`` [classes, 2, HOST_COLUMNS], without waiting:
    from pinned memory on a GPU."""
    host = torch.tensor(rows, dtype=torch.float32)
    if torch.device(device).type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


# --- running the formulas ------------------------------------------------------------------

def _piece_kernel(kind: str, target, main, state, grad, c):
    target.copy_(_value(kind, main, state, grad, c))


def _minor_kernel(kind: str, target, main, state, grad, index, c):
    value = _value(kind, main[index], tuple(s[index] for s in state),
                   None if grad is None else grad[index], c)
    target.index_copy_(0, index, value.to(target.dtype))


def _scalars_kernel(host, inv_scale, grads, excluded):
    return coefficients(host, inv_scale, grad_sumsq(grads, excluded))


class _Eager:
    """The formulas as eager torch ops, chunked."""

    name = "plain"

    @staticmethod
    def sumsq(grads, excluded):
        return grad_sumsq(grads, excluded)

    @staticmethod
    def coefficients(host, inv_scale, sumsq):
        return coefficients(host, inv_scale, sumsq)

    @staticmethod
    def scalars(host, inv_scale, grads, excluded):
        return coefficients(host, inv_scale, grad_sumsq(grads, excluded))

    @staticmethod
    def piece(kind, target, main, state, grad, c):
        c = c.unbind()
        for lo in range(0, main.numel(), PLAIN_CHUNK):
            sub = slice(lo, lo + PLAIN_CHUNK)
            _piece_kernel(kind, target[sub], main[sub], tuple(s[sub] for s in state),
                          None if grad is None else grad[sub], c)

    @staticmethod
    def minor(kind, target, main, state, grad, index, c):
        c = c.unbind()
        for lo in range(0, index.numel(), PLAIN_CHUNK):
            _minor_kernel(kind, target, main, state, grad, index[lo:lo + PLAIN_CHUNK], c)


class _Fused:
    """The formulas compiled (on first use: one graph per optimizer kind, dtype and whether a
    gradient is folded; sizes are dynamic), called outside Python dispatch modes: compiled code
    never dispatches through them and torch.compile will not trace under one. The kernels
    write in place and allocate nothing, so a memory meter misses nothing. ``frozen``: a call
    that would compile raises instead (``Pass.settle`` compiled every variant at start-up)."""

    name = "fused"

    def __init__(self, backend: Optional[str] = None):
        options = dict(dynamic=True, fullgraph=True)
        if backend is not None:  # a test's cheaper backend ("aot_eager"); default: inductor
            options["backend"] = backend
        self._sumsq = torch.compile(grad_sumsq, **options)
        self._coefficients = torch.compile(coefficients, **options)
        self._scalars = torch.compile(_scalars_kernel, **options)
        self._piece = torch.compile(_piece_kernel, **options)
        self._minor = torch.compile(_minor_kernel, **options)
        self.calls = 0  # compiled calls so far (one kernel or two each; counted by the tests)

    def _call(self, fn, *args, frozen: bool = False):
        from torch.utils._python_dispatch import _disable_current_modes

        stance = torch.compiler.set_stance("fail_on_recompile") if frozen \
            else contextlib.nullcontext()
        with _disable_current_modes(), stance:
            out = fn(*args)
        self.calls += 1
        return out

    def sumsq(self, grads, excluded, frozen=False):
        return self._call(self._sumsq, list(grads), list(excluded), frozen=frozen)

    def coefficients(self, host, inv_scale, sumsq, frozen=False):
        return self._call(self._coefficients, host, inv_scale, sumsq, frozen=frozen)

    def scalars(self, host, inv_scale, grads, excluded, frozen=False):
        return self._call(self._scalars, host, inv_scale, list(grads), list(excluded),
                          frozen=frozen)

    def piece(self, kind, target, main, state, grad, c, frozen=False):
        self._call(self._piece, kind, target, main, state, grad, c, frozen=frozen)

    def minor(self, kind, target, main, state, grad, index, c, frozen=False):
        self._call(self._minor, kind, target, main, state, grad, index, c, frozen=frozen)


_EAGER = _Eager()
_FUSED: Optional[_Fused] = None
_BROKEN: dict = {}  # device type -> why torch.compile failed there


def _fused() -> _Fused:
    global _FUSED
    if _FUSED is None:
        _FUSED = _Fused()
    return _FUSED


def fused_calls() -> int:
    """Compiled kernel calls so far in this process."""
    return 0 if _FUSED is None else _FUSED.calls


def _asked() -> str:
    asked = os.environ.get(KERNEL_ENV, "auto").lower()
    if asked not in ("auto", "fused", "plain"):
        raise ValueError(f"{KERNEL_ENV}={asked!r}: choose fused, plain or auto")
    return asked


def kernel_choice(device_type: str, strict: bool = True) -> str:
    """"fused" or "plain" for this device: ``PACI_PREDICTION_KERNEL`` when set, else fused
    where torch.compile works (tried once per device type on tiny tensors). ``strict``: a
    forced fused kernel that fails here raises (a stage's layout leaves that to ``settle``,
    after its ranks agreed, so that every rank of the stage stops, not one)."""
    asked = _asked()
    if asked == "plain":
        return "plain"
    if device_type not in _BROKEN:
        _BROKEN[device_type] = _try_fused(device_type)
    why = _BROKEN[device_type]
    if why and asked == "fused" and strict:
        raise RuntimeError(f"{KERNEL_ENV}=fused but torch.compile fails here: {why}")
    return "plain" if why else "fused"


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def _try_fused(device_type: str) -> str:
    """Compile and run the fused pass once on tiny tensors; '' if it agrees with the plain
    one, else why not."""
    try:
        device = torch.device(device_type)
        main = torch.linspace(-1, 1, 8, device=device)
        state = (main * 0.1, main.abs() * 0.01)
        klass = Klass("adam", dict(betas=(0.9, 0.95), eps=1e-8, lr=1e-3, weight_decay=0.1), None,
                      clip=0.5)
        rows = [host_coefficients(klass, (1e-3, 0.0), 3, 0.5)]
        out = {}
        for kernel in (_EAGER, _fused()):
            target = torch.zeros(8, dtype=torch.bfloat16, device=device)
            piece = Piece(target, main, state, main * 0.5, 0,
                          (Minor(torch.tensor([1, 5], device=device), 0),))
            trial = Pass("adam", [piece], [klass], kernel=kernel.name)
            trial.move_pieces(trial.pieces, trial.coefficients(
                scalars_to_device(rows, device), None, True, run=kernel), True, run=kernel)
            out[kernel.name] = target.float()
        torch.testing.assert_close(out["fused"], out["plain"], rtol=8e-3, atol=1e-6)
    except Exception as exc:  # a missing compiler, an unsupported backend
        why = _why(exc)
        warnings.warn(f"paci: weight prediction falls back to its plain pass on "
                      f"{device_type} (torch.compile failed: {why})")
        return why
    return ""


class _Guarded:
    """A pass's kernels with its fallback: a fused call that fails runs the same formulas as
    the plain pass, for that call, on this rank. No kernel call holds a collective (the
    clipping norm's reduction sits between two of them), so a fallback never repeats one;
    before ``settle`` a failure turns the pass plain, after it only the call (whatever failed
    after start-up is a variant start-up did not meet: a recompile, refused by then)."""

    def __init__(self, owner: "Pass"):
        self.owner = owner

    def __getattr__(self, name):
        fused, plain = getattr(_fused(), name), getattr(_EAGER, name)
        owner = self.owner

        def call(*args):
            if owner.kernel != "fused":
                return plain(*args)
            try:
                return fused(*args, frozen=owner.settled)
            except Exception as exc:  # a compile that failed, or one refused after settle
                owner.fell_back(name, exc)
            return plain(*args)

        return call


@dataclass
class Pass:
    """How one stage runs its prediction: its pieces and classes, the optimizer kind, the
    kernel (fused or plain), and what the clipping norm leaves out."""

    kind: str
    pieces: List[Piece]
    klasses: List[Klass]
    excluded: List[torch.Tensor] = field(default_factory=list)
    kernel: str = "plain"
    settled: bool = False  # ``settle`` decided the kernel for the run: nothing compiles later
    fallbacks: int = 0  # fused calls that ran the plain formulas instead

    @property
    def device(self):
        return self.pieces[0].main.device if self.pieces else torch.device("cpu")

    def _runner(self):
        return _Guarded(self) if self.kernel == "fused" else _EAGER

    def fell_back(self, name: str, exc: BaseException) -> None:
        """A fused call failed on this rank: its call runs plain (see ``_Guarded``)."""
        self.fallbacks += 1
        if self.fallbacks == 1:
            after = ("this call runs the plain pass; the kernels compiled at start-up stay"
                     if self.settled else "the pass runs plain from now on")
            warnings.warn(f"paci: weight prediction's fused {name} failed ({_why(exc)}): "
                          f"{after}")
        if not self.settled:
            self.kernel = "plain"

    def move(self, host: torch.Tensor, inv_scale, fold: bool,
             reduce_sumsq: Optional[Callable[[torch.Tensor], None]] = None) -> None:
        """Write every piece's prediction into its model weights. ``host``: the classes' rows
        on the device; ``fold``: fold the partial gradient in where its class allows it, with
        ``reduce_sumsq`` summing its squared norm over the stage's grad-stats group (where
        Megatron reduces its clipping norm) in place: once a move, whatever kernel fails."""
        coef = self.coefficients(host, inv_scale, fold, reduce_sumsq)
        self.move_pieces(self.pieces, coef, fold)

    def coefficients(self, host: torch.Tensor, inv_scale, fold: bool,
                     reduce_sumsq: Optional[Callable[[torch.Tensor], None]] = None, run=None):
        """The classes' coefficients on the device (the clipping norm and the finite flag
        need the whole stage's gradient: once, before any piece moves)."""
        run = run or self._runner()
        if not (fold and any(k.fold for k in self.klasses)):
            return run.coefficients(host, inv_scale, None)
        grads = [p.grad for p in self.pieces]
        if reduce_sumsq is None:
            return run.scalars(host, inv_scale, grads, self.excluded)
        sumsq = run.sumsq(grads, self.excluded)
        reduce_sumsq(sumsq)
        return run.coefficients(host, inv_scale, sumsq)

    def move_pieces(self, pieces: Sequence[Piece], coef: torch.Tensor, fold: bool,
                    run=None) -> None:
        """Move ``pieces`` (the stage's, or a layer's slices of them: ``layer_pieces``)."""
        run = run or self._runner()
        folds = [fold and k.fold for k in self.klasses]
        for piece in pieces:
            run.piece(self.kind, piece.target, piece.main, piece.state,
                      piece.grad if folds[piece.klass] else None, coef[piece.klass])
            for minor in piece.minors:
                run.minor(self.kind, piece.target, piece.main, piece.state,
                          piece.grad if folds[minor.klass] else None, minor.index,
                          coef[minor.klass])

    def settle(self, piece_sets: Sequence[Sequence[Piece]] = (), folds: Sequence[bool] = (True,
               False), inv_scale=None, agree: Optional[Callable[[bool], bool]] = None) -> str:
        """Decide the kernel once for the run, before the stream's first action: compile
        (and run) every fused variant the run will call, on its own pieces (``piece_sets``:
        each set of pieces it moves besides the whole stage, a layer's slices say; ``folds``:
        with and without the gradient; ``inv_scale``: the loss scale's inverse, as the run
        passes it), put the weights back, and let ``agree(ok)`` make the stage's ranks agree
        (an all-reduce of the flag: fused only where every rank compiled). Afterwards
        nothing compiles: a variant start-up did not meet runs plain (``_Guarded``), so the
        timed moves hold no compilation. Returns why the stage runs plain ("" when fused,
        or plain as asked); the second call does nothing."""
        if self.settled:
            return ""
        why = ""
        if self.kernel == "fused":
            try:
                self._compile(piece_sets, folds, inv_scale)
            except Exception as exc:
                why = f"torch.compile failed on this rank ({_why(exc)})"
            finally:
                self.restore()
        elif _asked() != "plain" and _BROKEN.get(self.device.type):
            why = f"torch.compile failed on this rank ({_BROKEN[self.device.type]})"
        ok = self.kernel == "fused" and not why
        # agree() answers a Python bool (its one host read is the start-up agreement, once a run)
        agreed = ok if agree is None else bool(agree(ok))
        if ok and not agreed:
            why = "torch.compile failed on another rank of the stage"
        self.kernel = "fused" if agreed else "plain"
        self.settled = True
        if why and _asked() == "fused":
            raise RuntimeError(f"{KERNEL_ENV}=fused, but the stage runs the plain pass: {why}")
        return why

    def _compile(self, piece_sets, folds, inv_scale) -> None:
        """Every fused call the run makes, once, with the real tensors and a step of 0 (the
        move writes the weights the restore writes), raising what fails."""
        run = _fused()
        rows = [host_coefficients(k, (0.0, 0.0), 0, 1.0) for k in self.klasses]
        host = scalars_to_device(rows, self.device)
        for fold in folds:
            if self.kind == "sgd" and not fold:
                continue  # nothing to predict from: no move (predict_ahead)
            coef = self.coefficients(host, inv_scale, fold, lambda sumsq: None, run=run)
            for pieces in (self.pieces, *piece_sets):
                self.move_pieces(pieces, coef, fold, run=run)

    def sliced(self, piece_index: int, lo: int, hi: int) -> Piece:
        """Elements [lo, hi) of one piece as a piece of its own (its minors re-indexed)."""
        piece = self.pieces[piece_index]
        minors = []
        for minor in piece.minors:
            inside = minor.index[(minor.index >= lo) & (minor.index < hi)] - lo
            if inside.numel():
                minors.append(Minor(inside, minor.klass))
        return Piece(piece.target[lo:hi], piece.main[lo:hi], tuple(s[lo:hi] for s in piece.state),
                     piece.grad[lo:hi], piece.klass, tuple(minors))

    def restore(self, pieces: Optional[Sequence[Piece]] = None) -> None:
        """The model weights as Megatron makes them from the main copies, bit for bit."""
        pieces = self.pieces if pieces is None else pieces
        if pieces:
            torch._foreach_copy_([p.target for p in pieces], [p.main for p in pieces])


def predict(stage_pass: Pass, rows: Sequence[Sequence[Sequence[float]]], inv_scale=None,
            fold: bool = True, reduce_sumsq: Optional[Callable[[torch.Tensor], None]] = None
            ) -> None:
    """Move the stage's weights to the prediction: ``rows`` from ``host_coefficients`` per
    class (their FACTOR a / k), ``inv_scale`` the loss scale's inverse on the device (None: 1),
    ``fold`` whether the gradient buffer is folded in at all."""
    host = scalars_to_device(rows, stage_pass.device)
    stage_pass.move(host, inv_scale, fold, reduce_sumsq)
