"""Frank-Wolfe optimizers: backprop FW, FGFW (Algorithm 1) and AFGFW (Algorithm 2), each a ``torch.optim.Optimizer``.

The package is laid out as torch's own optimizers are (``AdamW.step`` collects lists and calls a function that
knows nothing of the class):

* ``frank_wolfe.py`` and ``forward_gradient.py``: the torch.optim face, the classes. They validate arguments and
  param groups (with ``settings.py``), own the step counter, the seed and the schedules, save and load the state
  (``checkpoint.py``), and gather the step's direction: the backprop gradients, or the forward gradient's
  directional derivatives;
* ``plan.py``: the plan, built once per change of the groups: which fused call steps which tensors;
* ``functional.py``: the step, which only launches: each call on its path (a fused op of ``fgfw._ops``, which
  picks the backend, or multi-tensor torch ops).
"""
from .checkpoint import STATE_KEY
from .forward_gradient import AFGFW, ESTIMATORS, FGFW, _ForwardGradientFrankWolfe
from .frank_wolfe import FrankWolfe, _FrankWolfeBase
from .settings import CENTERS

__all__ = ["AFGFW", "CENTERS", "ESTIMATORS", "FGFW", "FrankWolfe", "STATE_KEY", "_FrankWolfeBase",
           "_ForwardGradientFrankWolfe"]
