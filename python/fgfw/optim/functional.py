"""The step: it only launches. Given a plan (plan.build_plan), the schedules and the direction (backprop or
estimated gradients, or the forward gradient's directional derivatives), :func:`fw_step` runs each call on its
path; none of these functions knows the optimizer classes (torch.optim's ``adamw()`` is the model)."""
from __future__ import annotations

from typing import Callable

import torch

from .. import _ops, constraints, reference, schedules
from .plan import Call, Plan


def device_scalar(x: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """x as a float64 0-dim tensor on device: a tensor is moved (a no-op where it lies), a number is
    written by a fill kernel rather than copied from the host."""
    if isinstance(x, torch.Tensor):
        return x.to(device, torch.float64)
    return torch.full((), float(x), dtype=torch.float64, device=device)


def schedules_of(plan: Plan, k: torch.Tensor, *, schedule_key: Callable[[dict], tuple],
                 averaging_weight: Callable[[dict, int | torch.Tensor], float | torch.Tensor],
                 skip: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Each call's (k, alpha_k, gamma_k), a float64 tensor on its device, evaluated before anything is
    modified (a callable schedule out of [0, 1] raises ``ValueError``), once per distinct schedule
    (``schedule_key``); gamma_k is ``averaging_weight(group, k)``. ``skip`` (a 0-dim tensor, not 0 for a step
    that must write nothing: the deferred finite check) is appended as a 4th element, read by the ops on the
    device (reference.schedule_values).

    On the CPU the counter (and a skip flag there) is read on the host (free) and the numbers are written at once; on a
    GPU, and under torch.compile, they are made on the device from the counter (schedules.evaluate), with
    no host-to-device copy nor synchronisation, so that a step can be captured. Both give the same bits, on
    any machine: a named schedule is the same sequence of IEEE operations either way (fgfw.schedules)."""
    host_k = int(k) if k.device.type == "cpu" and not torch.compiler.is_compiling() else None
    # a skip flag on the CPU is read there too (free), so that a CPU call's four numbers are one tensor made at once
    host_skip = float(skip) if host_k is not None and skip is not None and skip.device.type == "cpu" else None
    device_k = None
    made: dict[tuple, torch.Tensor] = {}
    out = []
    for call in plan.calls:
        group = call.group
        memo = (call.device, schedule_key(group))
        if memo not in made:
            if host_k is not None and call.device.type == "cpu":
                values = [host_k, schedules.evaluate(group["step_size"], host_k, "step_size"),
                          averaging_weight(group, host_k)]
                if host_skip is not None:
                    values.append(host_skip)
                made[memo] = torch.tensor(values, dtype=torch.float64)
            else:
                if device_k is None:
                    device_k = k.to(torch.float64)  # named schedules stay on the counter's device
                values = (device_k, schedules.evaluate(group["step_size"], device_k, "step_size"),
                          averaging_weight(group, device_k))
                made[memo] = torch.stack([device_scalar(x, call.device) for x in values])
            if skip is not None and made[memo].numel() == 3:
                made[memo] = torch.cat([made[memo], skip.to(call.device, torch.float64).reshape(1)])
        out.append(made[memo])
    return out


def gradients(plan: Plan, grads_of: Callable[[torch.Tensor], torch.Tensor | None]) -> list[list[torch.Tensor]]:
    """Each call's gradients as the op takes them: in its compute dtype (the masters' for halves), dense and
    contiguous (the kernels walk them as flat memory in the parameter's order: a non-contiguous one is
    copied), zeros where a global ball's parameter has none. Gathered for every call before any runs."""
    out = []
    for call in plan.calls:
        grads = [grads_of(p) for p in call.params]
        for t, zeros in call.zero_grads.items():
            grads[t] = zeros
        dtype = call.dtype
        if not all([g.layout == torch.strided and g.dtype == dtype and g.is_contiguous() for g in grads]):
            for t, (p, g) in enumerate(zip(call.params, grads)):
                if g.layout != torch.strided:
                    raise TypeError(f"Frank-Wolfe does not support sparse gradients (parameter of shape "
                                    f"{tuple(p.shape)}, gradient layout {g.layout})")
                grads[t] = g.to(dtype).contiguous()
        out.append(grads)
    return out


def forward_gradients(call: Call, coeffs: torch.Tensor, k: torch.Tensor, seed: int,
                      distribution: int) -> list[torch.Tensor]:
    """The forward-gradient estimate sum_t coeffs[t] u_t of each tensor of a call stepped through its vertex in
    torch ops (a set without a fused op), one tensor at a time (a vertex is per tensor anyway), the tangents drawn by the call's backend instead of the pure-torch
    stream that reference.fw_step_ would regenerate them with (the same values; many times faster). The
    arithmetic is reference.direction's, in the compute dtype, summed in tangent order."""
    out = []
    for p, start in zip(call.targets, call.starts):
        g = None
        for t in range(coeffs.numel()):
            u = _ops.fill_tangent_(torch.empty(p.shape, dtype=torch.float32, device=p.device), seed,
                                   k.to(p.device), t, start, distribution, call.backend)
            term = coeffs[t].to(call.dtype) * u.to(call.dtype)
            g = term if g is None else g + term
        out.append(g)
    return out


_FLOAT32_LIKES: dict = {}


def _float32_like(numel: int, device: torch.device) -> torch.Tensor:
    """A float32 tensor of ``numel`` elements on ``device`` to draw a run's tangent like (one element, expanded:
    tangents_at_step allocates a contiguous buffer for it and fills it, one op where empty + fill are two)."""
    like = _FLOAT32_LIKES.get((numel, device))
    if like is None:
        like = _FLOAT32_LIKES[(numel, device)] = torch.empty(1, dtype=torch.float32, device=device).expand(numel)
    return like


def run_forward_gradients(call: Call, coeffs: torch.Tensor, k: torch.Tensor, seed: int,
                          distribution: int, memo: dict | None = None) -> list[torch.Tensor]:
    """forward_gradients of an unconstrained call, flat, in multi-tensor ops: each run of consecutive places in the
    tangent stream (Call.runs) is drawn in one fill per tangent and split into its tensors, so that the number of
    ops does not grow with the number of tensors. The same arithmetic, so the same bits. ``memo``: kept between
    the calls of one step (the coefficients in each compute dtype, converted once)."""
    out: list[torch.Tensor] = []
    memo = {} if memo is None else memo
    cs = memo.get(("coefficients", coeffs.device, call.dtype))
    if cs is None:
        cs = memo[("coefficients", coeffs.device, call.dtype)] = coeffs.to(call.dtype).unbind()
    for first, sizes in call.runs:
        g = None
        for t, c in enumerate(cs):
            # a buffer per tangent: under torch.compile a refilled buffer was read after its refill (Inductor fused
            # the first tangent's term into a later kernel), and every term drew the last tangent
            u = _ops.tangents_at_step([_float32_like(sum(sizes), call.device)], seed, k.to(call.device), [t], [first],
                                      distribution, call.backend)[0]
            u = u if call.dtype == torch.float32 else u.to(call.dtype)
            term = torch._foreach_mul(list(u.split(sizes)[::2]), c)  # the tensors, not the padding between
            g = term if g is None else torch._foreach_add(g, term)
        out.extend(g)
    return out


def _torch_set_step(call: Call, grads: list[torch.Tensor], schedule: torch.Tensor, coeffs: torch.Tensor, seed,
                    distribution: int, gap: torch.Tensor, state) -> None:
    """A set stepped through its vertex in torch ops (reference.fw_step_)."""
    vertex = call.constraint.vertex
    if isinstance(call.constraint, constraints.NuclearNormBall):  # iterations from last step's v_1
        vertex = call.constraint.warm_started([state[p] for p in call.params])
    reference.fw_step_(vertex, call.targets, call.moms, grads, schedule, coeffs, call.radii, call.global_ball,
                       call.starts, seed, distribution, gap, call.row_numel, shrink=call.constraint.SHRINK_STEP,
                       rescale=call.group["rescale"], l2_diameter=call.constraint.l2_diameter,
                       row_vertices=call.constraint.row_vertices, feasibility=call.feasibility,
                       scales=call.scales, gauge_parts=call.constraint.gauge_parts
                       if call.constraint.CORRECTS_BY_GAUGE else None,
                       row_gauges=call.constraint.row_gauges,
                       batch_vertices=getattr(call.constraint, "batch_vertices", None))


def fw_step(plan: Plan, schedule: list[torch.Tensor], k: torch.Tensor, *, grads: list[list[torch.Tensor]] | None,
            tangent_coeffs: torch.Tensor | None, seed: int, distribution: int, state,
            make_state: Callable[[Call], None]) -> torch.Tensor | None:
    """The calls of the plan: the update itself (everything was checked before). ``grads``: each call's direction
    (``gradients``), or None for the forward gradient from ``tangent_coeffs`` (float64, one per tangent, already
    divided by their number) and the tangent stream of ``seed``. ``make_state`` makes a call's state at its first
    step; ``state`` is the optimizer's (the nuclear-norm ball's warm start). Returns the Frank-Wolfe gap summed
    over the calls, on the first call's device (no host synchronisation)."""
    coeffs_on = {} if tangent_coeffs is not None else plan.no_coeffs
    memo: dict = {}
    gaps = []
    seed = _ops._int64(int(seed))
    for c, call in enumerate(plan.calls):
        device = call.device
        if device not in coeffs_on:
            coeffs_on[device] = (tangent_coeffs.to(device) if tangent_coeffs is not None
                                 else torch.zeros(0, dtype=torch.float64, device=device))
        coeffs = coeffs_on[device]
        if call.targets is None:
            make_state(call)
        # the op writes it; an unconstrained call has no vertex, no share of the Frank-Wolfe gap
        gap = None if call.kind == "unconstrained" else torch.empty((), dtype=torch.float64, device=device)
        centers = call.centers
        if centers and schedule[c].numel() == 4:
            # a skipped step leaves theta as it was: it subtracts and adds back 0 (only a -0.0 can become +0.0)
            centers = torch._foreach_mul(centers, (schedule[c][3] == 0).to(call.dtype))
        if centers:  # a centred ball: the step is theta - c <- (1 - alpha)(theta - c) + alpha s
            torch._foreach_sub_(call.targets, centers)
        if call.kind == "l1":
            _ops.l1_fw_step_(call.targets, call.moms, grads[c] if grads is not None else [], schedule[c], coeffs,
                             call.radii, call.global_ball, call.starts, seed, distribution, gap,
                             backend=call.backend, row_numel=call.row_numel, prepared=True)
        elif call.kind == "set":
            _ops.set_fw_step_(call.fused_set[0], call.targets, call.moms, grads[c] if grads is not None else [],
                              schedule[c], coeffs, call.radii, call.global_ball, call.starts, seed,
                              distribution, gap, call.backend, call.row_numel, call.fused_set[1], call.scales)
        elif call.kind == "unconstrained":
            if grads is not None:
                _ops.gradient_step_(call.targets, call.moms, grads[c], schedule[c], call.backend)
            else:  # flat: the forward gradient is drawn one run of the tangent stream at a time
                _ops.gradient_step_(call.flat_targets, call.flat_moms,
                                    run_forward_gradients(call, coeffs, k, seed, distribution, memo), schedule[c],
                                    call.backend)
        else:
            call_grads = grads[c] if grads is not None else forward_gradients(call, coeffs, k, seed, distribution)
            _torch_set_step(call, call_grads, schedule[c], coeffs, seed, distribution, gap, state)
        if centers:
            torch._foreach_add_(call.targets, centers)
        if call.halves:
            # one rounding of a feasible float32 iterate: ||theta||_1 <= r (1 + u) in the half dtype
            torch._foreach_copy_([p for p, _ in call.halves], [m for _, m in call.halves])
        if gap is not None:
            gaps.append(gap)
    # summed where the first call's device is: no host synchronisation
    total = None
    for gap in gaps:
        total = gap if total is None else total + gap.to(total.device)
    if total is None and plan.calls:  # unconstrained calls only: a gap of 0
        total = torch.zeros((), dtype=torch.float64, device=plan.calls[0].device)
    return total
