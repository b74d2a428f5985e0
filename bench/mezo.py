"""MeZO, the baseline a user fine-tuning without a backward pass would pick instead of fgfw.

Written from the algorithm of S. Malladi, T. Gao, E. Nichani, A. Damian, J. D. Lee, D. Chen, S. Arora,
"Fine-Tuning Language Models with Just Forward Passes", NeurIPS 2023 (Algorithm 1), not from its code.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch


class MeZO:
    r"""Memory-efficient zeroth-order SGD (Malladi et al. 2023, Algorithm 1, constant learning rate).

    Step t, with a fresh seed s (drawn from ``seed``'s stream: same seed, same run):

    .. math::
        z &\sim \mathcal N(0, I_d) \text{ drawn from } s, \qquad
        \ell_+ = L(\theta + \epsilon z; B), \qquad \ell_- = L(\theta - \epsilon z; B) \\
        g &= (\ell_+ - \ell_-) / (2\epsilon) \qquad \text{(the projected gradient, } \approx \langle \nabla L, z \rangle) \\
        \theta &\leftarrow \theta - \eta\, g\, z

    Nothing parameter-sized is stored: the parameters are moved in place, theta -> theta + eps z ->
    theta - eps z -> theta (the paper's PerturbParameters with eps, -2 eps, eps), and z is drawn again from
    s, tensor by tensor, for every move and for the update. The memory above the weights is the
    forward's plus one tensor's z. The in-place moves restore theta up to the rounding of three additions
    (a float addition is not invertible, so no in-place scheme restores the bits; doing so would need the
    copy of the parameters that MeZO exists to avoid).

    Args:
        params: the parameters (tensors, any devices).
        lr: eta, the learning rate.
        eps: epsilon, the perturbation scale (the paper's default 1e-3).
        seed: seeds the per-step seeds s.

    ``step(closure)``: ``closure()`` returns the scalar loss of the current batch (it runs twice, under
    ``torch.no_grad()``; it must be deterministic: the same batch, no dropout). Returns ``ell_+``.
    ``last_projected_gradient`` and ``last_seed`` hold the step's g and s.
    """

    def __init__(self, params: Iterable[torch.Tensor], *, lr: float, eps: float = 1e-3, seed: int = 0):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("MeZO needs at least one parameter with requires_grad=True")
        if not (lr > 0 and eps > 0):
            raise ValueError(f"lr and eps must be > 0, got lr={lr!r}, eps={eps!r}")
        self.lr, self.eps = float(lr), float(eps)
        self._seeds = torch.Generator().manual_seed(seed)
        self.last_seed: int | None = None
        self.last_projected_gradient: float | None = None

    def perturbations(self, seed: int):
        """(parameter, z) for every parameter in order, z drawn from ``seed`` (one generator per device, so
        the same seed gives the same bits on a device every time)."""
        generators: dict[torch.device, torch.Generator] = {}
        for p in self.params:
            if p.device not in generators:
                generators[p.device] = torch.Generator(device=p.device).manual_seed(seed)
            yield p, torch.randn(p.shape, generator=generators[p.device], dtype=p.dtype, device=p.device)

    @torch.no_grad()
    def perturb_(self, seed: int, scale: float) -> None:
        """theta <- theta + scale z(seed), tensor by tensor (the paper's PerturbParameters)."""
        for p, z in self.perturbations(seed):
            p.add_(z, alpha=scale)

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor]) -> torch.Tensor:
        seed = int(torch.randint(2**62, (), generator=self._seeds))
        self.perturb_(seed, self.eps)
        loss_plus = closure().detach()
        self.perturb_(seed, -2 * self.eps)
        loss_minus = closure().detach()
        self.perturb_(seed, self.eps)
        g = float(loss_plus - loss_minus) / (2 * self.eps)
        self.perturb_(seed, -self.lr * g)
        self.last_seed, self.last_projected_gradient = seed, g
        return loss_plus
