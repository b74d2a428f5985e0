"""FGFW and AFGFW: the Frank-Wolfe optimizers whose direction comes from forward-mode directional derivatives (the
"weight" estimator, the paper's) or from tangents on layer outputs (the "activity" estimator, fgfw.activity)."""
from __future__ import annotations

import math
import warnings
from typing import Callable, Iterable

import torch
from torch import nn

from .. import _ops, activity, constraints, distributed, forward_grad, reference, schedules
from ..constraints import Constraint
from . import functional, plan as planning, settings
from .frank_wolfe import _FrankWolfeBase

# "weight": the paper's projected forward gradient, u over the parameters; "activity": u over the outputs
# of nn.Linear layers (fgfw.activity), far less variance, per-example losses needed.
ESTIMATORS = ("weight", "activity")


def _called_autograd(error: BaseException) -> bool:
    """Whether ``error`` was raised inside ``torch.autograd.backward`` or ``torch.autograd.grad``."""
    tb = error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_globals.get("__name__") == "torch.autograd" and frame.f_code.co_name in ("backward", "grad"):
            return True
        tb = tb.tb_next
    return False


def _batch_weight(batch_size: object) -> float:
    """A rank's weight in the data-parallel mean: its batch size, or 1 (equal weights) when not given."""
    if batch_size is None:
        return 1.0
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be None or an integer >= 1 (this rank's number of examples), got "
                         f"{batch_size!r}")
    return float(batch_size)


def _check_tangent_scale(tangent_scale: object, estimator: object, where: str) -> None:
    """``ValueError`` unless ``tangent_scale`` is a known scale that fits the estimator (``where``: the message's
    prefix for a loaded state)."""
    if not isinstance(tangent_scale, str) or tangent_scale not in activity.TANGENT_SCALES:
        raise ValueError(f"{where}tangent_scale must be one of {activity.TANGENT_SCALES}, got {tangent_scale!r}")
    if tangent_scale != "unit" and estimator != "activity":
        raise ValueError(f"{where}tangent_scale={tangent_scale!r} applies to estimator='activity' (the weight "
                         f"estimator's tangents are the stream's own, N(0, I) or Rademacher), got "
                         f"estimator={estimator!r}")


def _check_guided(guided: object, num_tangents: object, estimator: object, where: str) -> None:
    """``TypeError`` (a loaded state: ``ValueError``, as for its other entries) or ``ValueError`` unless AFGFW's
    ``guided`` fits its other arguments (``where``: the message's prefix for a loaded state)."""
    if not isinstance(guided, bool):
        raise (ValueError if where else TypeError)(f"{where}guided must be True or False, got {guided!r}")
    if guided and (isinstance(num_tangents, bool) or not isinstance(num_tangents, int) or num_tangents < 2):
        raise ValueError(f"{where}guided=True needs num_tangents >= 2 (one tangent along the running direction v, "
                         f"the others random ones orthogonal to it), got num_tangents={num_tangents!r}")
    if guided and estimator != "weight":
        raise ValueError(f"{where}guided=True applies to estimator='weight' (tangents over the parameters, where v "
                         f"lives), got estimator={estimator!r}")


class _ForwardGradientFrankWolfe(_FrankWolfeBase):
    """FGFW and AFGFW: the gradient estimate comes from forward-mode directional derivatives."""

    def __init__(self, module: nn.Module, params: Iterable | None, defaults: dict, *, constraint: Constraint,
                 seed: int | None, tangent: str, num_tangents: int, engine: str | None, backend: str | None,
                 check_finite: bool, tangents_in_one_pass: bool, estimator: str, recompute_inputs: bool,
                 process_group: object = distributed.AUTO, check_replicas_every: int = 0,
                 rescale: str | None = None, tangent_scale: str = "unit"):
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be the torch.nn.Module whose forward the closure runs, got "
                            f"{type(module).__name__} (pass the model, and its parameters or groups as params=)")
        if tangent not in reference.DISTRIBUTIONS:
            raise ValueError(f"tangent must be one of {sorted(reference.DISTRIBUTIONS)}, got {tangent!r}")
        if isinstance(num_tangents, bool) or not isinstance(num_tangents, int) or num_tangents < 1:
            raise ValueError(f"num_tangents must be an integer >= 1, got {num_tangents!r}")
        if estimator not in ESTIMATORS:
            raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
        _check_tangent_scale(tangent_scale, estimator, "")
        if recompute_inputs and estimator != "activity":
            raise ValueError("recompute_inputs=True applies to estimator='activity' (the weight estimator keeps no "
                             "inputs to recompute)")
        if estimator == "activity" and engine is not None:
            raise ValueError(f"engine selects the forward-mode engine of estimator='weight'; estimator='activity' "
                             f"always runs torch's forward AD (got engine={engine!r})")
        engine = forward_grad.DEFAULT_ENGINE if engine is None else engine
        if engine not in forward_grad.ENGINES:
            raise ValueError(f"engine must be one of {sorted(forward_grad.ENGINES)}, got {engine!r}")
        if tangents_in_one_pass and estimator == "weight" and not hasattr(forward_grad.ENGINES[engine], "batched"):
            raise ValueError(f"tangents_in_one_pass=True needs an engine with a batched form (\"lean\"), got "
                             f"engine={engine!r}")
        if isinstance(check_replicas_every, bool) or not isinstance(check_replicas_every, int) \
                or check_replicas_every < 0:
            raise ValueError(f"check_replicas_every must be an integer >= 0 (0: never), got {check_replicas_every!r}")
        explicit_seed = seed is not None
        if seed is None:
            seed = int(torch.empty((), dtype=torch.int64).random_())  # from torch's RNG: manual_seed fixes it
        elif isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
        group = distributed.resolve_group(process_group)
        self._replicas: distributed.Replicas | None = None
        self.check_replicas_every = check_replicas_every
        if params is None:
            params = [p for p in module.parameters() if p.requires_grad]
        constraints.register_modules(module)  # for the radius rules of zero-initialised balls
        params, tensors = settings.param_tensors(params)
        if group is not None and tensors:
            # the replicas start from the group's first rank's parameters (before radii are resolved from
            # them and the start is made feasible) and draw the same tangents
            self._replicas = distributed.Replicas(group, tensors[0].device)
            self._replicas.broadcast_(tensors)
            seed = self._replicas.agree_seed(seed, explicit_seed)
        self.module = module
        self.seed = seed
        self.tangent = tangent
        self.num_tangents = num_tangents
        self.tangents_in_one_pass = bool(tangents_in_one_pass)
        self.engine = engine
        self.estimator = estimator
        self.recompute_inputs = bool(recompute_inputs)
        self.tangent_scale = tangent_scale
        super().__init__(params, defaults, constraint=constraint, backend=backend, check_finite=check_finite,
                         rescale=rescale)
        module_params = {id(p) for p in module.parameters()}
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) not in module_params:
                    raise ValueError(f"params must be parameters of module; got a tensor of shape {tuple(p.shape)} "
                                     f"that module does not own (the JVP can only perturb the module's parameters)")
        if estimator == "activity":
            activity.perturbed_layers(module, [p for g in self.param_groups for p in g["params"]])

    _uses_tangent_stream = True
    guided = False  # AFGFW's guided tangents (see AFGFW)

    def _param_name(self, p: torch.Tensor) -> str | None:
        return next((name for name, q in self.module.named_parameters() if q is p), None)

    def _extra_state(self) -> dict:
        return dict(super()._extra_state(), seed=self.seed, tangent=self.tangent, num_tangents=self.num_tangents,
                    estimator=self.estimator, tangent_scale=self.tangent_scale)

    def _check_extra_state(self, extra: dict) -> None:
        # a state saved before the estimator (or tangent_scale) existed has none: the weight estimator's (unit tangents)
        super()._check_extra_state(dict({"estimator": "weight", "tangent_scale": "unit"}, **extra))
        seed, tangent, num_tangents = extra["seed"], extra["tangent"], extra["num_tangents"]
        estimator = extra.get("estimator", "weight")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"state_dict's seed must be an int, got {seed!r}")
        if not isinstance(tangent, str) or tangent not in reference.DISTRIBUTIONS:
            raise ValueError(f"state_dict's tangent must be one of {sorted(reference.DISTRIBUTIONS)}, got {tangent!r}")
        if isinstance(num_tangents, bool) or not isinstance(num_tangents, int) or num_tangents < 1:
            raise ValueError(f"state_dict's num_tangents must be an integer >= 1, got {num_tangents!r}")
        if not isinstance(estimator, str) or estimator not in ESTIMATORS:
            raise ValueError(f"state_dict's estimator must be one of {ESTIMATORS}, got {estimator!r}")
        if estimator != "activity" and self.recompute_inputs:
            raise ValueError(f"state_dict's estimator is {estimator!r}, but this optimizer was built with "
                             f"recompute_inputs=True, which applies to estimator='activity' only")
        _check_tangent_scale(extra.get("tangent_scale", "unit"), estimator, "state_dict's ")
        if estimator == "activity":  # every parameter must be held by a module (raises ValueError naming it)
            activity.perturbed_layers(self.module, [p for g in self.param_groups for p in g["params"]])

    def _load_extra_state(self, extra: dict) -> None:
        super()._load_extra_state(extra)
        self.seed, self.tangent, self.num_tangents = int(extra["seed"]), extra["tangent"], int(extra["num_tangents"])
        self.estimator = extra.get("estimator", "weight")
        self.tangent_scale = extra.get("tangent_scale", "unit")  # the saved run's, as the estimator

    def _guarded(self, closure: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """``closure`` with a clear error if it calls ``backward()`` or ``torch.autograd.grad`` (torch's own
        error, raised deep in the forward-mode pass, names neither the closure nor the way out)."""
        if torch.compiler.is_compiling():  # traced whole: no Python-level exception handling
            return closure
        name = type(self).__name__

        def guarded():
            try:
                return closure()
            except (RuntimeError, ValueError) as err:  # ValueError: the activity estimator's check refused it
                if not _called_autograd(err):
                    raise
                raise RuntimeError(
                    f"the closure passed to {name}.step called backward() (or torch.autograd.grad): {name} needs no "
                    f"backward pass, it runs the closure under forward-mode AD and no_grad, where there is no graph "
                    f"to differentiate. The closure must only compute and return the loss, e.g. "
                    f"opt.step(lambda: F.cross_entropy(model(x), y)); no loss.backward() and no zero_grad() "
                    f"(for backprop gradients use fgfw.FrankWolfe)") from err
        return guarded

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None, *, batch_size: int | None = None) -> torch.Tensor:
        """One step: ``num_tangents`` forward-mode passes of ``closure``, then the fused Frank-Wolfe update.

        ``closure`` (required) runs the model as usual and returns the scalar loss, e.g.
        ``opt.step(lambda: F.cross_entropy(model(x), y))``; it is called under forward-mode AD and no_grad
        (no backward pass, no stored activations), so it must not call ``backward()`` (that raises
        ``RuntimeError`` saying so). With ``estimator="activity"`` it returns the per-example losses instead
        (``reduction="none"``). Returns the (mean) loss at the pre-step parameters.

        Parameters frozen (``requires_grad=False``) since construction get no tangent and do not move (in a
        global ball they raise ``ValueError``); the others keep their place in the tangent stream.

        Data-parallel (a process group, see the class): every rank calls ``step`` with its own batch; the
        directional derivatives (the activity estimator: the estimate) are averaged over the ranks, weighted
        by ``batch_size`` (this rank's number of examples; None: equal weights), and every rank applies the
        same update. The returned loss is this rank's.
        """
        weight = _batch_weight(batch_size)
        if closure is None or not callable(closure):
            got = "no closure" if closure is None else f"a {type(closure).__name__}"
            raise TypeError(f"{type(self).__name__}.step needs a closure that computes the loss with the module, "
                            f"e.g. opt.step(lambda: F.cross_entropy(model(x), y)) (it runs the forward pass only: "
                            f"no loss.backward()); got {got}")
        self._report_nonfinite(wait=False)
        closure = self._guarded(closure)
        k = self._step_count_k + 1
        plan = self._prepared()
        params, offsets = plan.stream_params, plan.offsets
        distribution = reference.DISTRIBUTIONS[self.tangent]

        def fill(out: torch.Tensor, offset: int, tangent_id: int) -> torch.Tensor:
            """``out`` filled with tangent ``tangent_id`` of step k from ``offset`` of the stream."""
            return _ops.fill_tangent_(out, self.seed, k.to(out.device), tangent_id, offset, distribution,
                                      plan.tangent_backends[out.device])

        def draw(likes: list, tangent_ids: list, starts: list) -> list:
            """New tensors laid out as ``likes`` (one device), holding tangents ``tangent_ids`` of step k from
            ``starts``: one op."""
            return _ops.tangents_at_step(likes, self.seed, k.to(likes[0].device), tangent_ids, starts, distribution,
                                         plan.tangent_backends[likes[0].device])

        def tangent_maker(tangent_id: int):
            return _TangentMaker(params, offsets, tangent_id, fill, draw)

        if self.estimator == "activity":
            return self._activity_step(plan, k, params, closure, fill, weight)
        if self.guided:
            running = self._running_direction(params)
            if running is not None:  # v = 0 (the first step, a reset state): the plain estimate below
                return self._guided_step(plan, k, params, closure, fill, weight, *running)
        loss, coeffs = self._directional_derivatives(params, [tangent_maker(t) for t in range(self.num_tangents)],
                                                     closure)
        if self._replicas is not None:
            # every rank gets the same mean, non-finite on every rank if on one: they raise (or step) alike
            coeffs = self._replicas.mean_coefficients(coeffs, weight)
        self._coefficient_update(plan, k, coeffs)
        return loss

    def _directional_derivatives(self, params: list[torch.Tensor], makers: list, closure) -> tuple:
        """The loss and c_t = <grad f, u_t> (float64, one per tangent) for the tangents ``makers[t](j)`` (tangent t
        on ``params[j]``): one forward pass each, or all in one (tangents_in_one_pass)."""
        derivative = forward_grad.ENGINES[self.engine]
        if self.tangents_in_one_pass and len(makers) > 1:
            if all(isinstance(make, _TangentMaker) for make in makers):  # a parameter's K tangents in one op
                ids = [make.tangent_id for make in makers]
                stacked = lambda j: torch.stack(makers[0].draws(j, ids))  # noqa: E731
            else:
                stacked = lambda j: torch.stack([make(j) for make in makers])  # noqa: E731
            loss, coeffs = derivative.batched(self.module, params, stacked, closure, len(makers))
            return loss, coeffs.reshape(-1).to(torch.float64)
        if len(makers) == 1:
            loss, c = derivative(self.module, params, makers[0], closure)
            return loss, c.to(torch.float64).reshape(1)
        loss, coeffs = None, []
        for make in makers:
            loss_t, c = derivative(self.module, params, make, closure)
            loss = loss_t if loss is None else loss
            coeffs.append(c.reshape(()).to(torch.float64))
        return loss, torch.stack(coeffs)

    def _running_direction(self, params: list[torch.Tensor]) -> tuple[list, float] | None:
        """AFGFW's momentum v_{k-1} on ``params`` (None where a tensor has none) and its norm over all of them
        together, as the tangent stream runs through them; None where v = 0 (no state yet, or all zeros). The norm
        is read on the host: one synchronisation per guided step."""
        moms = [self.state.get(p, {}).get("momentum") for p in params]
        squares = [torch.dot(m.reshape(-1).to(torch.float64), m.reshape(-1).to(torch.float64)).to(params[0].device)
                   for m in moms if m is not None]
        norm = math.sqrt(float(torch.stack(squares).sum())) if squares else 0.0
        return (moms, norm) if 0.0 < norm < math.inf else None

    def _guided_step(self, plan: planning.Plan, k: torch.Tensor, params: list[torch.Tensor], closure, fill,
                     weight: float, moms: list, norm: float):
        """The step with guided=True (see AFGFW): tangent 0 is v_hat = v / ||v|| (``moms``, of norm ``norm``), the
        others the stream's u_t projected off it, P u_t = u_t - (v_hat . u_t) v_hat; the dense estimate
        g = c_0 v_hat + 1/(K-1) sum_t c_t P u_t goes through the gradient path of the fused op."""
        offsets = plan.offsets

        def unit(j: int) -> torch.Tensor:  # v_hat on params[j], in the momentum's (compute) dtype
            m = moms[j]
            return torch.zeros_like(params[j]) if m is None else m / norm

        def drawn(t: int, j: int) -> torch.Tensor:  # the stream's u_t on params[j], in the unit's dtype
            u = fill(torch.empty_like(params[j]), offsets[id(params[j])], t)
            return u.to(moms[j].dtype) if moms[j] is not None else u

        def dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.dot(a.reshape(-1).to(torch.float64), b.reshape(-1).to(torch.float64)).to(params[0].device)

        # v_hat . u_t over all parameters together, before the passes: the projection needs the whole dot product
        along = {t: torch.stack([dot(unit(j), drawn(t, j)) for j in range(len(params))]).sum()
                 for t in range(1, self.num_tangents)}

        def projected(t: int, j: int) -> torch.Tensor:
            v_hat = unit(j)
            return drawn(t, j) - along[t].to(v_hat.device, v_hat.dtype) * v_hat

        makers = [lambda j: unit(j).to(params[j].dtype)]
        makers += [lambda j, t=t: projected(t, j).to(params[j].dtype) for t in range(1, self.num_tangents)]
        loss, coeffs = self._directional_derivatives(params, makers, closure)
        if self._replicas is not None:  # v and the tangents are the same on every rank: only the c_t are averaged
            coeffs = self._replicas.mean_coefficients(coeffs, weight)
        grads = {}
        for j, p in enumerate(params):
            v_hat = unit(j)
            g = coeffs[0].to(v_hat.device, v_hat.dtype) * v_hat
            for t in range(1, self.num_tangents):
                g += coeffs[t].to(v_hat.device, v_hat.dtype) / (self.num_tangents - 1) * projected(t, j)
            grads[id(p)] = g
        nonfinite = (~torch.isfinite(coeffs).all().to(k.device) | _ops.nonfinite(list(grads.values()), k.device)
                     if self.check_finite else None)
        self._apply(plan, k, nonfinite, grads=functional.gradients(plan, lambda p: grads[id(p)]), tangent_coeffs=None,
                    seed=0, distribution=0)
        self._check_replicas(k)
        return loss

    def _coefficient_update(self, plan: planning.Plan, k: torch.Tensor, coeffs: torch.Tensor) -> None:
        """What a step does after its forward passes: the update from the directional derivatives ``coeffs``
        (float64, one per tangent), skipped on the device where one is not finite (check_finite)."""
        # c * 0 is 0 for a finite c and NaN for inf or NaN: three ops where ~isfinite(c).all() dispatches six
        nonfinite = torch.mul(coeffs, 0).ne_(0).any() if self.check_finite else None
        mean = coeffs if self.num_tangents == 1 else coeffs / self.num_tangents
        self._apply(plan, k, nonfinite, grads=None, tangent_coeffs=mean, seed=self.seed,
                    distribution=reference.DISTRIBUTIONS[self.tangent])
        self._check_replicas(k)

    @torch.no_grad()
    def _update_from_coefficients(self, coeffs: torch.Tensor) -> None:
        """step() without its forward passes: the plan, the schedule and the update from the directional
        derivatives ``coeffs`` (float64, one per tangent). Benchmarks time the update alone through it
        (bench/optimizer_step.py's afgfw_update, bench/step_overhead.py)."""
        k = self._step_count_k + 1
        plan = self._prepared()
        self._coefficient_update(plan, k, coeffs)

    def _direction_name(self) -> str:
        if self.estimator == "activity":
            return "the activity-perturbed gradient estimate"
        return "the directional derivative <grad f, u>"

    def _check_replicas(self, k: torch.Tensor) -> None:
        """Every check_replicas_every steps, ``RuntimeError`` on every rank if the replicas' parameters differ."""
        if self._replicas is not None and self.check_replicas_every and int(k) % self.check_replicas_every == 0:
            self._replicas.check_identical([p for g in self.param_groups for p in g["params"]], int(k))

    def _activity_step(self, plan: planning.Plan, k: torch.Tensor, params: list[torch.Tensor], closure, fill,
                       weight: float):
        """The step with estimator='activity': tangents on linear outputs (drawn by ``fill``, the stream of
        step k), a dense estimate, the gradient path of the fused op (see fgfw.activity)."""
        loss, grads = activity.activity_gradients(self.module, params, closure, fill, self.num_tangents,
                                                  self.tangents_in_one_pass, self.recompute_inputs, self.tangent_scale)
        if self._replicas is not None:
            self._replicas.mean_dense_(list(grads.values()), weight)
        nonfinite = _ops.nonfinite(list(grads.values()), k.device) if self.check_finite else None
        self._apply(plan, k, nonfinite, grads=functional.gradients(plan, lambda p: grads[id(p)]), tangent_coeffs=None,
                    seed=0, distribution=0)
        self._check_replicas(k)
        return loss


class FGFW(_ForwardGradientFrankWolfe):
    r"""Projected forward-gradient Frank-Wolfe (the paper's Algorithm 1). No backward pass.

    .. math::
        u_k &\sim \mathcal N(0, I), \qquad \hat g_k = \langle \nabla f(\theta_k), u_k\rangle\, u_k \\
        s_k &= \arg\min_{s \in C} \langle \hat g_k, s \rangle \\
        \theta_{k+1} &= (1-\alpha_k)\,\theta_k + \alpha_k s_k

    The directional derivative ``c = <grad f, u>`` comes from one forward-mode pass per tangent; with
    ``num_tangents = K`` the estimate is the mean of K such terms. FGFW converges only to a neighbourhood
    of the optimum (Theorem 1): its estimate's variance does not vanish. See :class:`AFGFW`.

    Args:
        module: the model the closure runs (its parameters are perturbed by the tangents).
        params: the parameters or param groups to optimize (default: the module's trainable parameters).
            Frozen ones (``requires_grad=False``) are left out with a warning: never perturbed nor updated.
            Each group may bring its own ``constraint``, ``step_size`` (and, for AFGFW, ``averaging_weight``);
            the K tangents run through all groups' parameters together (one directional derivative).
        constraint: e.g. ``fgfw.L1Ball(radius=...)``.
        step_size: alpha_k (default the paper's ``"2/(k+2)"``).
        seed: seed of the tangent stream (default: drawn from torch's RNG). Same seed, same run.
        tangent: ``"gaussian"`` (the paper) or ``"rademacher"``.
        num_tangents: K tangents per step (K forward passes; the estimate is their mean).
        tangents_in_one_pass: carry the K tangents through ONE forward pass (vmap over the lean JVP rules:
            the primal is computed once, tangent memory grows with K). Not for modules that update buffers
            in place (BatchNorm in train mode raises ``ValueError``).
        engine: forward-mode engine from ``fgfw.forward_grad.ENGINES``: ``"lean"`` (default: just-in-time
            tangents, lean rules) or ``"forward_ad"`` (torch's stock forward-mode AD, the reference).
        backend, check_finite: as in :class:`FrankWolfe`; a non-finite directional derivative raises
            ``ValueError`` (deferred, as there) and leaves parameters and state untouched.
        estimator: ``"weight"`` (default, the paper's: tangents over the parameters) or ``"activity"``
            (tangents over the outputs of the layers that hold the parameters, see :mod:`fgfw.activity`,
            which says which outputs are per example and which shared by the batch; the closure must return
            per-example losses, e.g.
            ``F.cross_entropy(logits, y, reduction="none")``, whose mean is minimised, and ``engine``
            does not apply). Far lower variance; it keeps each perturbed layer's input during the pass.
        recompute_inputs: with ``estimator="activity"``, keep no layer input through the forward-mode pass
            and run the closure once more, plainly, to build the estimate layer by layer: memory of an
            inference forward plus a parameter-sized estimate, for one extra forward. The closure must be
            deterministic (no dropout in train mode); a second pass that differs raises ``ValueError``.
        tangent_scale: with ``estimator="activity"``, the standard deviation of each perturbed output's tangent:
            ``"unit"`` (default, N(0, I)) or ``"rms"`` (the output's root mean square in this pass). The
            estimate stays unbiased (it divides by the same scale). On
            models with LayerNorms, ``"rms"`` cuts the variance that the small-scale outputs upstream of a
            LayerNorm (embeddings, residual branches), whose gradients are large, add to every other layer's
            estimate (see :mod:`fgfw.activity`).
        process_group: data parallelism over ``torch.distributed`` (see :mod:`fgfw.distributed`):
            ``"auto"`` (default) uses the default group when torch.distributed is initialised with more
            than one process; ``None`` never communicates; or a ``ProcessGroup``. At construction the
            parameters are broadcast from the group's first rank and the seed is agreed (rank 0's; a rank
            given another seed raises ``ValueError`` on every rank). Each step all-reduces the K directional
            derivatives and the rank's batch weight (8 (K + 1) bytes; the activity estimator: its dense
            estimate) and every rank applies the same update: the replicas stay bit-identical. Buffers
            (e.g. BatchNorm statistics) are not synchronised.
        rescale: as in :class:`FrankWolfe`.
        check_replicas_every: with a process group, every this many steps compare a checksum of the
            parameters' bits across ranks and raise ``RuntimeError`` naming the step if they differ
            (0: never; each check is one small all-gather and a host read).
    """

    def __init__(self, module: nn.Module, params: Iterable | None = None, *, constraint: Constraint,
                 step_size: schedules.Schedule = "2/(k+2)", seed: int | None = None, tangent: str = "gaussian",
                 num_tangents: int = 1, engine: str | None = None, backend: str | None = None,
                 check_finite: bool = True, tangents_in_one_pass: bool = False, estimator: str = "weight",
                 recompute_inputs: bool = False, process_group: object = distributed.AUTO,
                 check_replicas_every: int = 0, rescale: str | None = None, tangent_scale: str = "unit"):
        super().__init__(module, params, dict(step_size=step_size), constraint=constraint, seed=seed,
                         tangent=tangent, num_tangents=num_tangents, engine=engine, backend=backend,
                         check_finite=check_finite, tangents_in_one_pass=tangents_in_one_pass, estimator=estimator,
                         recompute_inputs=recompute_inputs, process_group=process_group,
                         check_replicas_every=check_replicas_every, rescale=rescale, tangent_scale=tangent_scale)
        if tangent == "rademacher" and num_tangents == 1 and estimator == "weight":
            # g_hat = c u has |g_hat_i| = |c| everywhere: the argmax is always a ball's first element
            warnings.warn("FGFW with one Rademacher tangent always picks the first element of each ball (every "
                          "|g_hat_i| is equal); use tangent='gaussian', num_tangents > 1, or AFGFW", stacklevel=2)


class AFGFW(_ForwardGradientFrankWolfe):
    r"""Averaged (variance-reduced) projected forward-gradient Frank-Wolfe (the paper's Algorithm 2).

    .. math::
        u_k &\sim \mathcal N(0, I), \qquad \hat g_k = \langle \nabla f(\theta_k), u_k\rangle\, u_k \\
        v_k &= (1-\gamma_k)\, v_{k-1} + \gamma_k\, \hat g_k, \qquad v_0 = 0 \\
        s_k &= \arg\min_{s \in C} \langle v_k, s \rangle \\
        \theta_{k+1} &= (1-\alpha_k)\,\theta_k + \alpha_k s_k

    Defaults are the paper's schedules, alpha_k = 1/k and gamma_k = 1/sqrt(k) (k counts steps from 1;
    note alpha_1 = 1 replaces theta by a vertex at the first step). ``averaging_weight`` is gamma_k, the
    weight of the NEW estimate (``v = (1 - gamma) v + gamma g_hat``; FrankWolfe's ``momentum`` rho is the
    weight of the old one, rho = 1 - gamma); ``"4/(k+8)^(2/3)"`` is stochastic Frank-Wolfe's momentum rule
    in this convention. The momentum v is kept in float32 for float16/bfloat16 parameters. Other arguments
    as in :class:`FGFW`, and:

    Args:
        guided: spend one of the K >= 2 directional derivatives of a step on the running direction (issue 31,
            item 3; default False). With :math:`\hat v = v_{k-1} / \|v_{k-1}\|` (the momentum over all
            perturbed parameters of all groups together, as the tangent stream runs) and
            :math:`P = I - \hat v \hat v^\top`:

            .. math::
                c_0 = \langle \nabla f(\theta_k), \hat v\rangle, \qquad
                c_t = \langle \nabla f(\theta_k), P u_t\rangle \ (t = 1..K-1), \qquad
                \hat g_k = c_0\, \hat v + \tfrac{1}{K-1} \textstyle\sum_t c_t\, P u_t

            with u_t the stream's tangents t = 1..K-1 of step k (the same ones as without ``guided``). What holds:
            since E[u u^T] = I (Gaussian and Rademacher) and v_{k-1} depends only on the past,
            E[g_hat_k | past] = v_hat v_hat^T grad f + P grad f = grad f: the estimate is unbiased conditionally on
            the past, which is what the paper's Lemma 4 and Theorems 2-3 use. Its component along v_hat is exact;
            its error lies in v_hat's complement, E[||g_hat - grad f||^2 | past] = d ||P grad f||^2 / (K-1)
            (Gaussian; at most that for Rademacher), against (d+1) ||grad f||^2 / K for the plain estimate with
            K tangents: lower when v is aligned with the gradient (for K = 2, when cos^2(v, grad f) > 1/2 roughly),
            at most about twice it otherwise. The bounds of the proofs, of the form C ||grad f||^2, hold with
            C = d / (K-1); the rates are the paper's, the constants differ. When v = 0 (the first step, a
            state without momentum) the step takes the plain estimate. Costs: K forward passes as before (one with
            ``tangents_in_one_pass``); before them one global dot product v_hat . u_t per random tangent (a
            regeneration of u_t) and a host read of ||v|| (one synchronisation per step, and a graph break under
            torch.compile); the estimate is dense
            and goes through the fused op's gradient path, so a step holds one parameter-sized estimate more.
            Data parallel: v and the tangents are the same on every replica, so only the K coefficients are
            averaged, as without it. Needs ``estimator="weight"`` and ``num_tangents >= 2`` (``ValueError``
            otherwise); saved in ``state_dict`` (a state loaded brings its own setting). FGFW takes no ``guided``:
            it has no running direction, and the last step's update alpha (s - theta) would point at a vertex,
            not along a gradient estimate. Measured (bench/RESULTS.md, "Guided tangents"), at equal forward
            passes against K = 2 plain: better where v tracks the gradient (L1 least squares, d = 50), worse where
            it does not (d = 500, and fine-tuning a 0.44 M-parameter GPT-2); hence off by default.
    """

    def __init__(self, module: nn.Module, params: Iterable | None = None, *, constraint: Constraint,
                 step_size: schedules.Schedule = "1/k", averaging_weight: schedules.Schedule = "1/sqrt(k)",
                 seed: int | None = None, tangent: str = "gaussian", num_tangents: int = 1, engine: str | None = None,
                 backend: str | None = None, check_finite: bool = True, tangents_in_one_pass: bool = False,
                 estimator: str = "weight", recompute_inputs: bool = False, process_group: object = distributed.AUTO,
                 check_replicas_every: int = 0, rescale: str | None = None, tangent_scale: str = "unit",
                 guided: bool = False):
        _check_guided(guided, num_tangents, estimator, "")
        self.guided = guided
        super().__init__(module, params, dict(step_size=step_size, averaging_weight=averaging_weight),
                         constraint=constraint, seed=seed, tangent=tangent, num_tangents=num_tangents, engine=engine,
                         backend=backend, check_finite=check_finite, tangents_in_one_pass=tangents_in_one_pass,
                         estimator=estimator, recompute_inputs=recompute_inputs, process_group=process_group,
                         check_replicas_every=check_replicas_every, rescale=rescale, tangent_scale=tangent_scale)

    _SCHEDULE_KEYS = ("step_size", "averaging_weight")

    def _extra_state(self) -> dict:
        return dict(super()._extra_state(), guided=self.guided)

    def _check_extra_state(self, extra: dict) -> None:
        # a state saved before guided tangents existed has none: the plain estimate's
        super()._check_extra_state(dict({"guided": False}, **extra))
        _check_guided(extra.get("guided", False), extra["num_tangents"], extra.get("estimator", "weight"),
                      "state_dict's ")

    def _load_extra_state(self, extra: dict) -> None:
        super()._load_extra_state(extra)
        self.guided = extra.get("guided", False)

    def _check_group_hyperparameters(self, group: dict) -> None:
        super()._check_group_hyperparameters(group)
        schedules.check_schedule(group["averaging_weight"], "averaging_weight")

    def _schedule_key(self, group: dict) -> tuple:
        return (settings.spec_key(group["step_size"]), settings.spec_key(group["averaging_weight"]))

    def _uses_momentum(self, group: dict) -> bool:
        return True

    def _averaging_weight(self, group: dict, k: torch.Tensor) -> float | torch.Tensor:
        return schedules.evaluate(group["averaging_weight"], k, "averaging_weight")


class _TangentMaker:
    """Tangent ``tangent_id`` of a step on ``params[j]``: ``maker(j)``, and ``maker.many(js)`` for several
    parameters at once (one op, where they share a device; the lean engine asks so for a layer's weight and bias)."""

    __slots__ = ("params", "offsets", "tangent_id", "fill", "draw")

    def __init__(self, params, offsets, tangent_id: int, fill, draw):
        self.params, self.offsets, self.tangent_id, self.fill, self.draw = params, offsets, tangent_id, fill, draw

    def __call__(self, j: int) -> torch.Tensor:
        p = self.params[j]
        return self.fill(torch.empty_like(p), self.offsets[id(p)], self.tangent_id)

    def many(self, js: list) -> list:
        likes = [self.params[j] for j in js]
        if any(p.device != likes[0].device for p in likes):
            return [self(j) for j in js]
        return self.draw(likes, [self.tangent_id] * len(likes), [self.offsets[id(p)] for p in likes])

    def draws(self, j: int, tangent_ids: list) -> list:
        """Tangents ``tangent_ids`` of ``params[j]`` (the K tangents of a pass that carries them all), in one op."""
        p = self.params[j]
        return self.draw([p] * len(tangent_ids), list(tangent_ids), [self.offsets[id(p)]] * len(tangent_ids))
