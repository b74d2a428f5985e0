"""Fine-tuning from a real starting point (issue 23, item 2): AFGFW, FGFW and MeZO against backprop.

Two tasks, sized for a 2-core CPU (one torch thread):

* ``text``: a byte-level ("character") GPT-2 (Hugging Face, 2 layers x 128, 4 heads, context 64, 0.4 M
  parameters) pre-trained with Adam on Python's standard library (the ``.py`` files at its top level),
  fine-tuned on the C++ headers that ship with torch (``torch/include/c10``). The headers are split by
  file: every 10th file is the test split, every 10th after the first the validation split.
* ``mnist``: an MLP 784-256-256-10 pre-trained with Adam on MNIST digits 0-4, fine-tuned on 5-9 (all ten
  outputs kept). MNIST's test set (``--data``, IDX files) split as ``fgfw.data.mnist_split`` does; the
  fine-tuning images of its training part again every 4th into validation.

Methods: ``adam`` and ``frankwolfe`` (backprop; FrankWolfe with momentum 0.9), ``afgfw`` (the paper's
weight estimator, lean engine, one tangent), ``afgfw_activity`` (tangents on the layers' outputs, one
tangent), ``fgfw`` (Algorithm 1, weight estimator, one tangent) and ``mezo`` (bench/mezo.py, eps 1e-3).
The Frank-Wolfe methods take one L1 ball per row of 2x its pre-trained L1 norm (``relative_to_init(2)``,
not tuned); every step size is constant. The ``*_centred`` methods take the same method with the balls centred
at the pre-trained weights (param group ``center="init"``): each row may move by CENTRED_SCALE = 0.5 x its
pre-trained L1 norm from where it started, instead of being pulled towards 0 by every step. ``afgfw_k2_centred``
and ``afgfw_guided_centred`` (issue 31, item 3) are ``afgfw_centred`` with two tangents per step, plain and
guided (AFGFW's ``guided=True``: one tangent along the running direction v, one random tangent orthogonal to it).
``afgfw_avg001_*`` is AFGFW with averaging weight 0.01 instead of 0.1 (a running direction over ~100 estimates),
``afgfw_l2_*`` AFGFW in L2 balls (per row, 0.5 x the pre-trained row's L2 norm, centred) instead of L1 balls.
``_rescaled`` steps with ``rescale="gradient"`` (a step as long as alpha x the estimate, alpha a learning rate),
``_wide`` in balls of WIDE_SCALE x the row's norm, ``_split`` perturbs the LayerNorms and the other layers in
alternate passes (two optimizers taking turns; LayerNorm models only, asked for by name), and ``_decay`` scales the k-th step's alpha by 1 - (k - 1) / n,
down to 0 at the end of a budget of n steps (passes only: a ``_decay`` method has no wall-clock run).
The ``*_subset`` methods (issue 31, BitFit-style) fine-tune only ``subset_params(model, SUBSET)`` (``--subset``:
every LayerNorm weight and bias and every bias, 3,584 of the text model's 0.44 M parameters, or that plus ``wpe`` or
the attention's output projections) and freeze the rest: the forward-gradient methods perturb and step only the
subset (one param group), MeZO perturbs only it; ``adam_subset`` is the subset's ceiling with backprop.

Budgets. Forward passes: a backprop step counts 1 (its backward is not counted), a forward-gradient step
with one tangent 1, with two tangents 2, a MeZO step 2 (its two forwards); every method gets ``--passes``. Wall clock: every
method trains until its steps (evaluation excluded) have taken ``--seconds``.

Protocol, fixed before the runs: the model is pre-trained once (seed 0). For each method, every step
size of its grid (``GRIDS``) fine-tunes with seed 0 at the forward-pass budget and is scored by the
validation loss at the end; the lowest wins (a winner at the edge of its grid is flagged). The chosen
step size then fine-tunes with seeds 0, 1, 2 (the fine-tuning batches, the tangents, MeZO's z) at both
budgets; the validation loss is recorded along the way and the test split is read once, at the end of
each run.

    python bench/finetune.py --task mnist --data ../shared/data/mnist
    python bench/finetune.py --task text
    # pre-trains once (--pretrained), later invocations load it
    python bench/finetune.py --task text --methods adam_subset,mezo_subset,afgfw_subset_centred --pretrained /tmp/p.pt

``--pretrained FILE`` caches the pre-trained model (deterministic, so the cached model is the one a run would make).

Writes ``finetune_<task>.csv`` (every run's end: validation, and test for the final runs) and
``finetune_<task>_curves.csv`` into ``--out``, and ``finetune_<task>.png`` into ``--figures``.

GPT-2 small on a GPU (issue 31, item 4): ``--model gpt2-small`` is the text task at the size users fine-tune,
Hugging Face ``GPT2LMHeadModel`` with GPT-2 small's configuration (12 layers x 768, 12 heads, 1,024 positions,
vocabulary 50,257: 124 M parameters, float32, dropout 0), context 512, batch 8 x 512. The text stays byte-level, so only
token ids < 256 occur; the vocabulary is GPT-2's so that the embedding, the head and its logits, and with them
the time and memory, are the real model's. Nothing is downloaded: the model is pre-trained here, with Adam
(lr 6e-4, GPT-2 small's rate from scratch; no warm-up) for ``--pretrain-steps`` (300) steps on the same
pre-training corpus, then fine-tuned on the same headers. No step-size grid and one seed (0): every method
fine-tunes once at the step size the text task chose above (``TEXT_CHOSEN``, bench/RESULTS.md; not tuned at this
size, ``--grid METHOD=STEP`` overrides one) for ``--passes`` (200) forward passes, or until its steps have taken
``--seconds`` (30 s, a cap so the run fits its time on a GPU; the CSV's ``passes`` says when it bit). Methods:
``MEZO_COMPARISON``. Each row: the test loss of the pre-trained start and at the end; the median time of a step
(the run's own steps after its first, evaluation excluded; reading each step's loss waits for its device work)
and per forward pass (a step's time over the passes it counts: a backprop step counts one, so its backward is in
its pass); the peak memory above what was allocated before the run: the copy of the pre-trained model, its
optimizer's state and a step's working memory (CUDA: ``torch.cuda.max_memory_allocated`` after a reset, over the
copy and every step; CPU: ``fgfw.lean.measure_peak``, torch's profiler, over a separate copy taking two steps; both
count tensors, not the process's resident set); and both as ratios to MeZO's. ``--quick`` shrinks the model to a
miniature of the same code path (two layers x 96, two heads, context 16, vocabulary 512; batch 2, 5 pre-training
steps, 8 passes) for a CPU smoke run. The corpora are the running Python's standard library and the running
torch's headers, so figures belong to those versions.

    python bench/finetune.py --task text --model gpt2-small --device cuda     # ~3 min on an H200 (estimated)
    python bench/finetune.py --task text --model gpt2-small --device cpu --quick

Writes ``finetune_text_gpt2_small_<device>.csv`` into ``--out``, rewritten after every method, so that a run cut
short keeps the methods it finished.
"""
from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import sys
import sysconfig
import time

import torch
import torch.nn.functional as F
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from mezo import MeZO  # noqa: E402

METHODS = ("adam", "frankwolfe", "afgfw", "afgfw_activity", "fgfw", "mezo", "frankwolfe_centred", "afgfw_centred",
           "afgfw_activity_centred", "fgfw_centred", "afgfw_activity_rms_centred", "afgfw_k2_centred",
           "afgfw_guided_centred", "adam_subset", "mezo_subset", "frankwolfe_subset_centred", "fgfw_subset_centred",
           "afgfw_subset_centred", "afgfw_k2_subset_centred", "afgfw_guided_subset_centred",
           "afgfw_avg001_subset_centred", "afgfw_l2_subset_centred", "afgfw_l2_rescaled_subset_centred",
           "afgfw_l2_rescaled_wide_subset_centred", "fgfw_l2_rescaled_wide_subset_centred",
           "afgfw_avg001_l2_rescaled_wide_subset_centred", "afgfw_activity_l2_rescaled_centred",
           "afgfw_activity_l2_rescaled_wide_centred", "afgfw_activity_avg001_l2_rescaled_wide_centred",
           "afgfw_avg001_l2_rescaled_wide_centred", "afgfw_activity_avg001_l2_rescaled_wide_decay_centred",
           "afgfw_avg001_l2_rescaled_wide_decay_subset_centred", "afgfw_activity_rms_avg001_l2_rescaled_wide_centred",
           "afgfw_activity_rms_split_centred")
# a run without --methods: the subset methods and the split one (issue 31; LayerNorm models) are asked for by name
DEFAULT_METHODS = tuple(m for m in METHODS if "_subset" not in m and "_split" not in m)
GRIDS = {  # step sizes tried on the validation split (Adam and MeZO: learning rates; the rest: alpha)
    "adam": (1e-4, 3e-4, 1e-3),
    "frankwolfe": (3e-3, 1e-2, 3e-2),
    "afgfw": (3e-4, 1e-3, 3e-3),
    "afgfw_activity": (3e-3, 1e-2, 3e-2),
    "fgfw": (1e-4, 3e-4, 1e-3),
    "mezo": (1e-5, 1e-4, 1e-3),
    # balls around the pre-trained weights (center="init"): first run with the grids of the same methods around 0,
    # where every choice fell at an edge (FrankWolfe and activity at 3e-3, the smallest; weight at 3e-3, the
    # largest); these grids are that run's, moved one step past the edge (bench/RESULTS.md)
    "frankwolfe_centred": (1e-3, 3e-3, 1e-2),
    "afgfw_centred": (1e-3, 3e-3, 1e-2),
    "afgfw_activity_centred": (1e-3, 3e-3, 1e-2),
    # added for the text task (issue 31) by the same rule: FGFW around 0 chose 1e-4, its grid's smallest
    "fgfw_centred": (3e-5, 1e-4, 3e-4),
    # issue 31 item 2: tangents scaled to each output's RMS; the whole range the unit tangents were tried on
    # (centred, with extensions), where they diverged at 3e-3 and 1e-2
    "afgfw_activity_rms_centred": (1e-4, 3e-4, 1e-3, 3e-3, 1e-2),
    # two tangents (issue 31, item 3), plain and guided: around the one-tangent centred AFGFW's choice, 1e-4
    "afgfw_k2_centred": (3e-5, 1e-4, 3e-4),
    "afgfw_guided_centred": (3e-5, 1e-4, 3e-4),
    # a subset of the parameters (SUBSET; issue 31): fixed before any subset run. Adam and MeZO one decade above
    # their full-model choices at the centre (a few thousand parameters take larger steps: BitFit's rates are
    # 1e-3-1e-2); the Frank-Wolfe methods from their centred full-model choice upwards, since an estimate over ~100x
    # fewer parameters has ~100x less variance and should bear a larger alpha
    "adam_subset": (3e-3, 1e-2, 3e-2),
    "mezo_subset": (1e-4, 1e-3, 1e-2),
    "frankwolfe_subset_centred": (1e-3, 3e-3, 1e-2),
    "fgfw_subset_centred": (3e-5, 1e-4, 3e-4),
    "afgfw_subset_centred": (1e-4, 3e-4, 1e-3),
    "afgfw_k2_subset_centred": (1e-4, 3e-4, 1e-3),
    "afgfw_guided_subset_centred": (1e-4, 3e-4, 1e-3),
    # added after the subset's first run (every forward-gradient method stayed within 0.04 of the start while
    # FrankWolfe on the exact gradient reached 2.54): AFGFW averaging over ~100 estimates instead of ~10; the grid
    # of afgfw_subset_centred
    "afgfw_avg001_subset_centred": (1e-4, 3e-4, 1e-3),
    # added after that (bench/RESULTS.md): AFGFW in L2 balls, whose vertex -r d / ||d|| follows the whole estimate
    # where the L1 ball's takes its largest entry; a wide grid, its step lengths being unlike the L1 ball's
    "afgfw_l2_subset_centred": (1e-4, 1e-3, 1e-2),
    # added after that: the step's length follows the estimate (rescale="gradient": min(alpha ||v|| / ||theta - s||,
    # 1) per ball, SGD's step alpha v until it reaches the vertex) instead of alpha x the distance to the vertex, in
    # the L2 balls above and in balls WIDE_SCALE x wider; alpha is then a learning rate: MeZO's subset grid, extended
    # one step up (its choice, 1e-2, sat at the old grid's edge)
    "afgfw_l2_rescaled_subset_centred": (1e-3, 3e-3, 1e-2, 3e-2),
    "afgfw_l2_rescaled_wide_subset_centred": (1e-3, 3e-3, 1e-2, 3e-2),
    "fgfw_l2_rescaled_wide_subset_centred": (1e-3, 3e-3, 1e-2, 3e-2),
    # added after those three (the wide ball still pulled): averaging over ~100 estimates, whose v is ~3x shorter
    # for the same signal, so that the pull, alpha_ball ~ alpha ||v|| / r, is too
    "afgfw_avg001_l2_rescaled_wide_subset_centred": (1e-3, 3e-3, 1e-2, 3e-2),
    # the same step rule for the activity estimator (MNIST's target, issue 31): alpha a learning rate on its
    # estimate, SGD's range for this MLP
    "afgfw_activity_l2_rescaled_centred": (1e-3, 3e-3, 1e-2, 3e-2, 1e-1),
    "afgfw_activity_l2_rescaled_wide_centred": (1e-3, 3e-3, 1e-2, 3e-2, 1e-1),
    # added after it (85.8 % on MNIST): averaging over ~100 estimates, as on the text subset
    "afgfw_activity_avg001_l2_rescaled_wide_centred": (1e-3, 3e-3, 1e-2, 3e-2, 1e-1),
    # the text subset's best (afgfw_avg001_l2_rescaled_wide_subset_centred) on every parameter (d 122x larger): the
    # rescaled step alpha ||v|| grows as sqrt(d), so its grid one decade lower
    "afgfw_avg001_l2_rescaled_wide_centred": (1e-4, 3e-4, 1e-3, 3e-3),
    # the best of each task with its step decayed linearly to 0 over the run's passes (``_decay``): the grids of the
    # same methods with a constant step
    "afgfw_activity_avg001_l2_rescaled_wide_decay_centred": (1e-3, 3e-3, 1e-2, 3e-2, 1e-1),
    "afgfw_avg001_l2_rescaled_wide_decay_subset_centred": (1e-3, 3e-3, 1e-2, 3e-2),
    # the text model's best full-model step rule with the activity estimator and its LayerNorm-scaled tangents (issue
    # 31, item 2): the grid on which the activity estimator's divergence was measured
    "afgfw_activity_rms_avg001_l2_rescaled_wide_centred": (1e-4, 3e-4, 1e-3, 3e-3, 1e-2),
    # fewer perturbed sites per pass (issue 31, item 2): the LayerNorms and the other layers in alternate passes
    # (``_split``), RMS-scaled tangents; afgfw_activity_rms_centred's grid
    "afgfw_activity_rms_split_centred": (1e-4, 3e-4, 1e-3, 3e-3, 1e-2),
}
# the centred methods' balls: one L1 ball per row around the pre-trained row, of this fraction of its L1 norm
CENTRED_SCALE = 0.5
# the *_wide_* methods' balls: this fraction of the row's norm, 10x CENTRED_SCALE (every Frank-Wolfe step pulls theta
# towards the centre by alpha_ball x its offset; a wider ball, a smaller alpha_ball for the same step length)
WIDE_SCALE = 5.0
PASSES_PER_STEP = {"mezo": 2, "afgfw_k2_centred": 2, "afgfw_guided_centred": 2, "mezo_subset": 2,
                   "afgfw_k2_subset_centred": 2, "afgfw_guided_subset_centred": 2}  # every other method: 1
# the *_subset methods' parameters (subset_params' kind), chosen by Adam's validation loss (bench/RESULTS.md)
SUBSET = "ln_bias"
SEEDS = (0, 1, 2)
# the step sizes the text task chose on its validation split (bench/RESULTS.md, "Text" and the sections after it):
# --model gpt2-small's fixed settings
TEXT_CHOSEN = {"adam": 1e-3, "frankwolfe": 3e-3, "afgfw": 3e-4, "afgfw_activity": 3e-3, "fgfw": 1e-4, "mezo": 1e-4,
               "frankwolfe_centred": 1e-3, "afgfw_centred": 1e-4, "afgfw_activity_centred": 1e-4, "fgfw_centred": 3e-5,
               "afgfw_activity_rms_centred": 1e-4, "afgfw_k2_centred": 3e-4, "afgfw_guided_centred": 1e-4,
               # "Text: fine-tuning a subset of the parameters" (guided: at the edge, where it barely moves)
               "adam_subset": 1e-2, "mezo_subset": 1e-2, "frankwolfe_subset_centred": 3e-3, "fgfw_subset_centred": 1e-4,
               "afgfw_subset_centred": 3e-4, "afgfw_k2_subset_centred": 1e-4, "afgfw_guided_subset_centred": 3e-6,
               "afgfw_avg001_subset_centred": 1e-4, "afgfw_l2_subset_centred": 1e-3}
# --model gpt2-small's methods by default: MeZO first, the yardstick of the ratios
MEZO_COMPARISON = ("mezo", "afgfw_centred", "fgfw_centred", "frankwolfe_centred", "adam")
# --model: (GPT-2 architecture, batch size, context, pre-training steps, pre-training learning rate)
TEXT_MODELS = {
    "byte": (dict(n_layer=2, n_embd=128, n_head=4, vocab_size=256), 16, 64, 1500, 1e-3),
    "gpt2-small": (dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024), 8, 512, 300, 6e-4),
}
# its CPU miniature (--quick): weights (1 MiB) above a step's activations, so that a peak without them shows
GPT2_SMALL_QUICK = (dict(n_layer=2, n_embd=96, n_head=2, vocab_size=512, n_positions=32), 2, 16, 5, 6e-4)


# -- tasks -------------------------------------------------------------------------------------------------------------
class Task:
    """A model to pre-train and fine-tune, its data and losses. ``batch(split, generator)`` draws a batch on
    ``device``; ``loss(model, batch, per_example)`` is the training loss; ``evaluate(model, split)`` -> (loss,
    accuracy)."""

    name = ""
    pretrain_steps = 0
    pretrain_lr = 1e-3
    batch_size = 0
    device = torch.device("cpu")

    def model(self) -> nn.Module:
        raise NotImplementedError


class TextTask(Task):
    name = "text"
    eval_windows = 128

    def __init__(self, quick: bool = False, model: str = "byte", device: str = "cpu"):
        self.arch, self.batch_size, self.length, self.pretrain_steps, self.pretrain_lr = \
            GPT2_SMALL_QUICK if quick and model == "gpt2-small" else TEXT_MODELS[model]
        self.device = torch.device(device)
        stdlib = sysconfig.get_paths()["stdlib"]
        headers = os.path.join(os.path.dirname(torch.__file__), "include", "c10")
        self.pretrain = self._bytes(sorted(os.path.join(stdlib, f) for f in os.listdir(stdlib) if f.endswith(".py")))
        files = sorted(os.path.join(d, f) for d, _, fs in os.walk(headers) for f in fs if f.endswith(".h"))
        self.splits = {"train": self._bytes([f for i, f in enumerate(files) if i % 10 not in (0, 1)]),
                       "val": self._bytes(files[1::10]), "test": self._bytes(files[0::10])}
        if quick:
            self.pretrain_steps, self.eval_windows = 5, 4

    @staticmethod
    def _bytes(paths) -> torch.Tensor:
        data = b"".join(open(p, "rb").read() for p in paths)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()

    def model(self) -> nn.Module:
        from real_models import build_model
        return build_model("gpt2", self.arch, self.length)

    def _windows(self, tokens, starts):
        w = torch.stack([tokens[s:s + self.length + 1] for s in starts.tolist()]).to(self.device)
        return w[:, :-1], w[:, 1:]

    def batch(self, split, generator):
        tokens = self.pretrain if split == "pretrain" else self.splits[split]
        return self._windows(tokens, torch.randint(0, len(tokens) - self.length - 1, (self.batch_size,),
                                                   generator=generator))

    def loss(self, model, batch, per_example=False):
        from real_models import make_loss
        return make_loss(model, "gpt2", *batch, per_example)()

    @torch.no_grad()
    def evaluate(self, model, split):
        # the same evenly spaced windows every time: a deterministic score
        tokens = self.splits[split]
        starts = torch.linspace(0, len(tokens) - self.length - 2, self.eval_windows).long()
        losses = [float(self.loss(model, self._windows(tokens, chunk))) for chunk in starts.split(64)]
        return statistics.fmean(losses), None


class MnistTask(Task):
    name, pretrain_steps, batch_size = "mnist", 400, 64

    def __init__(self, data: str, quick: bool = False):
        from fgfw.data import mnist_split

        (x, y), (x_test, y_test) = mnist_split(data)
        old, new = y < 5, y >= 5
        x_new, y_new = x[new], y[new]
        held = torch.arange(len(y_new)) % 4 == 3
        self.pretrain = (x[old], y[old])
        self.splits = {"train": (x_new[~held], y_new[~held]), "val": (x_new[held], y_new[held]),
                       "test": (x_test[y_test >= 5], y_test[y_test >= 5])}
        if quick:
            self.pretrain_steps = 5

    def model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))

    def batch(self, split, generator):
        x, y = self.pretrain if split == "pretrain" else self.splits[split]
        i = torch.randint(0, len(y), (self.batch_size,), generator=generator)
        return x[i], y[i]

    def loss(self, model, batch, per_example=False):
        x, y = batch
        return F.cross_entropy(model(x), y, reduction="none" if per_example else "mean")

    @torch.no_grad()
    def evaluate(self, model, split):
        x, y = self.splits[split]
        logits = model(x)
        return float(F.cross_entropy(logits, y)), float((logits.argmax(1) == y).double().mean())


# -- methods -----------------------------------------------------------------------------------------------------------
SUBSET_KINDS = ("ln_bias", "ln_bias_wpe", "ln_bias_attn_proj")


def subset_params(model: nn.Module, kind: str = "ln_bias") -> list[nn.Parameter]:
    """The parameters a ``*_subset`` method fine-tunes (BitFit-style), in ``model.parameters()`` order.

    ``kind``: ``"ln_bias"``, every parameter of every ``nn.LayerNorm`` (weight and bias) and every parameter
    whose name ends in ``bias`` (on the text task's GPT-2: 3,584 of 0.44 M); ``"ln_bias_wpe"`` adds the position
    embedding (``wpe``, 8,192 more); ``"ln_bias_attn_proj"`` adds the attention's output projections (the
    weights of the modules ``*.attn.c_proj``, 32,768 more). Picked by module type and parameter name, not by shape: a tied or
    shared parameter appears once."""
    if kind not in SUBSET_KINDS:
        raise ValueError(f"kind must be one of {SUBSET_KINDS}, got {kind!r}")
    chosen = set()
    for module_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if (isinstance(module, nn.LayerNorm) or name == "bias"
                    or (kind == "ln_bias_wpe" and module_name.split(".")[-1] == "wpe")
                    or (kind == "ln_bias_attn_proj" and module_name.endswith("attn.c_proj"))):
                chosen.add(id(p))
    return [p for p in model.parameters() if id(p) in chosen]


def layernorm_params(model: nn.Module) -> set[int]:
    """The ids of every ``nn.LayerNorm``'s parameters (a ``_split`` method's first half)."""
    return {id(p) for m in model.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()}


def make_step(method: str, model: nn.Module, task: Task, step_size: float, seed: int,
              decay_steps: int | None = None):
    """step(batch) -> training loss of one step of ``method``.

    A ``_decay`` method (a Frank-Wolfe one) steps with ``step_size x (1 - (k - 1) / decay_steps)`` at its k-th step,
    from ``step_size`` at the first down to 0 after ``decay_steps`` steps: the linear decay to zero over a known
    budget that noisy SGD is usually run with.

    A ``_subset`` method freezes (``requires_grad=False``) every parameter of ``model`` outside
    ``subset_params(model, SUBSET)``: backprop computes no gradient for them, MeZO and the forward-gradient
    optimizers never perturb nor move them."""
    import fgfw

    if "_subset" in method:
        keep = {id(p) for p in subset_params(model, SUBSET)}
        for p in model.parameters():
            p.requires_grad_(id(p) in keep)
        method = method.replace("_subset", "")
    if "_decay" in method:
        if decay_steps is None or decay_steps < 1:
            raise ValueError(f"{method}: a decaying step needs decay_steps >= 1 (a budget in steps), got {decay_steps}")
        alpha = step_size
        step_size = lambda k: alpha * max(0.0, 1.0 - (k - 1) / decay_steps)  # noqa: E731
        method = method.replace("_decay", "")
    params = [p for p in model.parameters() if p.requires_grad]
    if method == "mezo":
        opt = MeZO(params, lr=step_size, eps=1e-3, seed=seed)
        return lambda batch: opt.step(lambda: task.loss(model, batch))
    centred = method.endswith("_centred")
    method = method.removesuffix("_centred")
    # around 0: 2x the pre-trained row norm; centred: the pre-trained row plus CENTRED_SCALE x its norm
    kind_of_ball = fgfw.L2Ball if "_l2" in method else fgfw.L1Ball
    scale = WIDE_SCALE if "_wide" in method else CENTRED_SCALE if centred else 2.0
    ball = kind_of_ball.relative_to_init(scale, scope="row")
    groups = [{"params": params, "constraint": ball, "center": "init" if centred else None}]
    if method in ("adam", "frankwolfe"):
        opt = (torch.optim.Adam(params, lr=step_size) if method == "adam" else
               fgfw.FrankWolfe(groups, constraint=ball, step_size=step_size, momentum=0.9))

        def step(batch):
            loss = task.loss(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()
        return step
    kind = fgfw.FGFW if method.startswith("fgfw") else fgfw.AFGFW
    options = dict(estimator="activity") if method.startswith("afgfw_activity") else {}
    if "_rescaled" in method:
        options["rescale"] = "gradient"
    if method.startswith("afgfw_activity_rms"):
        options["tangent_scale"] = "rms"
    if method in ("afgfw_k2", "afgfw_guided"):
        options = dict(num_tangents=2, guided=method == "afgfw_guided")
    if kind is fgfw.AFGFW:
        options["averaging_weight"] = 0.01 if "_avg001" in method else 0.1
    per_example = method.startswith("afgfw_activity")
    if "_split" in method:
        # fewer perturbed sites per pass: one optimizer for the LayerNorms, one for the rest, taking turns, so that
        # each pass's directional derivatives carry the noise of half the model's outputs (seeds apart: their own
        # tangents)
        norms = layernorm_params(model)
        halves = [[p for p in params if id(p) in norms], [p for p in params if id(p) not in norms]]
        if not all(halves):
            raise ValueError(f"{method}: needs LayerNorms and other layers to take turns, got "
                             f"{len(halves[0])} LayerNorm and {len(halves[1])} other parameters")
        opts = [kind(model, [dict(groups[0], params=half)], constraint=ball, step_size=step_size,
                     seed=seed + 1000 * i, **options) for i, half in enumerate(halves)]
        taken = [0]

        def step(batch):
            taken[0] += 1
            return opts[(taken[0] - 1) % 2].step(lambda: task.loss(model, batch, per_example))
        step.optimizers = opts
        return step
    opt = kind(model, groups, constraint=ball, step_size=step_size, seed=seed, **options)

    def step(batch):
        return opt.step(lambda: task.loss(model, batch, per_example))
    step.optimizer = opt  # for the tests: the settings a method name stands for
    return step


def pretrain(task: Task) -> nn.Module:
    torch.manual_seed(0)
    model = task.model().to(task.device)  # initialised on the CPU: the same start on every device
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=task.pretrain_lr)
    generator = torch.Generator().manual_seed(0)
    for _ in range(task.pretrain_steps):
        task.loss(model, task.batch("pretrain", generator)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def pretrain_cached(task: Task, path: str | None, model: str, quick: bool) -> tuple[nn.Module, bool]:
    """(:func:`pretrain`'s model, whether it came from ``path``). The pre-training is deterministic (seed 0), so a
    cached copy made with the same task, model, pre-training steps and torch is the model this run would make;
    another key pre-trains again and replaces the file."""
    key = dict(task=task.name, model=model, quick=quick, arch=getattr(task, "arch", None),
               pretrain_steps=task.pretrain_steps, pretrain_lr=task.pretrain_lr, torch=torch.__version__)
    if path and os.path.exists(path):
        saved = torch.load(path, map_location="cpu", weights_only=True)
        if saved.get("key") == repr(key):
            net = task.model()
            net.load_state_dict(saved["state"])
            return net.to(task.device), True
    net = pretrain(task)
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        torch.save(dict(key=repr(key), state=net.state_dict()), path)
    return net, False


def peak_memory(task: Task, start: nn.Module, method: str, step_size: float, steps: int = 2) -> int:
    """Bytes at the peak while a copy of ``start`` takes ``steps`` steps of ``method``, above what was allocated
    before (``fgfw.lean.measure_peak``): the copy's weights, its optimizer's state and a step's working memory. Two
    steps, so that state the first step makes (Adam's moments, the momentum v) is held through a whole step; the
    steps after repeat the second's allocations."""
    from fgfw.lean import measure_peak

    generator = torch.Generator().manual_seed(2000)
    batches = [task.batch("train", generator) for _ in range(steps)]

    def run():
        model = copy.deepcopy(start)
        step = make_step(method, model, task, step_size, 0, decay_steps=steps if "_decay" in method else None)
        for batch in batches:
            try:
                step(batch)
            except ValueError:  # fgfw's check_finite refused the estimate after the step's work: still measured
                pass
    return measure_peak(run, task.device)[1]


def fine_tune(task: Task, start: nn.Module, method: str, step_size: float, seed: int, *, passes: int | None = None,
              seconds: float | None = None, points: int = 10, test: bool = False,
              memory: bool = False) -> tuple[dict, list[dict]]:
    """One fine-tuning run from a copy of ``start`` until ``passes`` forward passes or ``seconds`` of training.

    Returns (the end: validation loss, the median milliseconds of a step after the first, and the test split's loss
    and accuracy when ``test``; the validation curve: ``points`` + 1 points, by passes or by seconds).

    ``memory``: the end also has ``peak_mib``, the run's peak above what was allocated before it: the copy's weights,
    its optimizer's state, a step's working memory. On CUDA the caching allocator's peak from the copy to the last
    step (reset there, read there: with ``points=0`` no evaluation falls inside); on the CPU :func:`peak_memory`'s
    separate copy and two steps (torch's profiler, too slow to keep on through the run)."""
    curve = [dict(passes=0, seconds=0.0, val_loss=task.evaluate(start, "val")[0])]
    if memory:
        gc.collect()  # an earlier run's model and optimizer, which refer to each other, out of the baseline
    on_cuda = memory and task.device.type == "cuda"
    if memory and not on_cuda:
        peak = peak_memory(task, start, method, step_size)
    elif on_cuda:
        if points:
            raise ValueError(f"memory=True on CUDA measures the steps alone: needs points=0, got points={points}")
        torch.cuda.synchronize(task.device)
        torch.cuda.reset_peak_memory_stats(task.device)
        held = torch.cuda.memory_allocated(task.device)
    model = copy.deepcopy(start)
    torch.manual_seed(seed)
    per_step = PASSES_PER_STEP.get(method, 1)
    step = make_step(method, model, task, step_size, seed,
                     decay_steps=-(-passes // per_step) if "_decay" in method and passes else None)
    generator = torch.Generator().manual_seed(1000 + seed)
    done = elapsed = 0.0
    step_seconds = []
    diverged = False
    next_point = 1
    while (passes is None or done < passes) and (seconds is None or elapsed < seconds):
        batch = task.batch("train", generator)
        begin = time.perf_counter()
        try:
            loss = float(step(batch))  # reading the loss waits for the step's device work
        except ValueError:  # fgfw's check_finite: a non-finite estimate left the parameters as they were
            loss = float("nan")
        step_seconds.append(time.perf_counter() - begin)
        elapsed += step_seconds[-1]
        done += per_step
        progress = done / passes if passes is not None else elapsed / seconds
        if loss != loss or loss == float("inf"):
            diverged = True
            break
        if points and progress >= next_point / points:
            curve.append(dict(passes=done, seconds=elapsed, val_loss=task.evaluate(model, "val")[0]))
            next_point = int(progress * points) + 1
    if on_cuda:
        peak = torch.cuda.max_memory_allocated(task.device) - held  # every step read its loss: nothing pending
    end = dict(method=method, step_size=step_size, seed=seed, passes=done, seconds=elapsed, diverged=diverged,
               val_loss=float("inf") if diverged else task.evaluate(model, "val")[0],
               ms_per_step=1e3 * statistics.median(step_seconds[1:] or step_seconds))  # the first: warm-up
    if memory:
        end["peak_mib"] = peak / 2**20
    if test:
        end["test_loss"], end["test_accuracy"] = task.evaluate(model, "test") if not diverged else (float("inf"), None)
    return end, curve


def compare(task: Task, start: nn.Module, steps: dict[str, float], passes: int, seconds: float | None, path: str,
            common: dict) -> list[dict]:
    """Issue 31, item 4: each method of ``steps`` (method -> step size) fine-tunes ``start`` once (seed 0); its
    time and peak memory beside MeZO's. The rows are written to ``path`` after every method."""
    from fgfw.experiments import write_csv

    common = dict(common, test_loss_start=task.evaluate(start, "test")[0])
    rows = []
    for method, step_size in steps.items():
        end, _ = fine_tune(task, start, method, step_size, 0, passes=passes, seconds=seconds, points=0, test=True,
                           memory=True)
        end.pop("test_accuracy")
        rows.append(dict(common, **end, ms_per_pass=end["ms_per_step"] / PASSES_PER_STEP.get(method, 1)))
        mezo = next((r for r in rows if r["method"] == "mezo"), None)
        for row in rows:
            row["time_vs_mezo"] = row["ms_per_pass"] / mezo["ms_per_pass"] if mezo else None
            row["memory_vs_mezo"] = row["peak_mib"] / mezo["peak_mib"] if mezo else None
        write_csv(path, rows)
        print(f"  {method} step {step_size:g}: {end['passes']:.0f} passes, {end['ms_per_step']:.1f} ms per step, "
              f"peak {end['peak_mib']:.1f} MiB, test loss {common['test_loss_start']:.4f} -> {end['test_loss']:.4f}",
              flush=True)
    return rows


def main() -> None:
    global SUBSET  # --subset: make_step reads it
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=("text", "mnist"), required=True)
    parser.add_argument("--data", default=os.path.join(HERE, "..", "..", "shared", "data", "mnist"),
                        help="MNIST IDX folder (task mnist)")
    parser.add_argument("--methods", default=None, help="comma-separated (default: METHODS but the *_subset ones; "
                        "gpt2-small: MEZO_COMPARISON)")
    parser.add_argument("--model", choices=tuple(TEXT_MODELS), default="byte",
                        help="the text task's model; gpt2-small: issue 31, item 4's comparison (the docstring)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--passes", type=int, default=None,
                        help="forward-pass budget (text 400, mnist 2000, gpt2-small 200)")
    parser.add_argument("--seconds", type=float, default=None,
                        help="wall-clock budget (text 10, mnist 4); gpt2-small: each method's cap (30)")
    parser.add_argument("--pretrain-steps", type=int, default=None,
                        help="Adam steps of pre-training (text 1500, mnist 400, gpt2-small 300)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="a smoke run: a few steps, one seed, one step size "
                        "(gpt2-small: its miniature)")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--figures", default=os.path.join(HERE, "figures"))
    parser.add_argument("--suffix", default="", help="appended to the output files' names (finetune_<task><suffix>)")
    parser.add_argument("--grid", action="append", default=[], metavar="METHOD=STEP,STEP,...",
                        help="a method's step sizes for this run instead of GRIDS' (a grid extended past its edge)")
    parser.add_argument("--select-only", action="store_true", help="the step-size selection only, no seeds")
    parser.add_argument("--budgets", default="passes,seconds",
                        help="the final runs' budgets, comma-separated: passes, seconds (a shared machine's seconds "
                             "say little)")
    parser.add_argument("--subset", choices=SUBSET_KINDS, default=SUBSET,
                        help=f"the parameters the *_subset methods fine-tune (subset_params; default {SUBSET})")
    parser.add_argument("--pretrained", default=None, metavar="FILE",
                        help="a cache of the pre-trained model: loaded when FILE holds one made with the same task, "
                             "model and pre-training steps, else pre-trained and saved there")
    args = parser.parse_args()
    SUBSET = args.subset
    comparison = args.model != "byte"
    if args.task != "text" and (comparison or args.device != "cpu"):
        parser.error(f"--model {args.model} --device {args.device}: the text task only (got --task {args.task})")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no GPU (torch.cuda.is_available() is False)")
    torch.set_num_threads(args.threads)
    task = TextTask(args.quick, args.model, args.device) if args.task == "text" else MnistTask(args.data, args.quick)
    if args.pretrain_steps is not None:
        task.pretrain_steps = args.pretrain_steps
    if comparison:
        passes = args.passes or (8 if args.quick else 200)
        seconds = args.seconds or (None if args.quick else 30.0)
    else:
        passes = args.passes or (4 if args.quick else 400 if args.task == "text" else 2000)
        seconds = args.seconds or (0.2 if args.quick else 10.0 if args.task == "text" else 4.0)
    methods = args.methods.split(",") if args.methods else list(MEZO_COMPARISON if comparison else DEFAULT_METHODS)
    if unknown := [m for m in methods if m not in METHODS]:
        parser.error(f"--methods: {', '.join(unknown)} not among {', '.join(METHODS)}")
    grids = {m: (TEXT_CHOSEN[m],) if comparison else GRIDS[m][1:2] if args.quick else GRIDS[m] for m in methods}
    for spec in args.grid:
        method, _, steps = spec.partition("=")
        if method not in grids:
            parser.error(f"--grid {spec!r}: {method!r} is not among --methods")
        grids[method] = tuple(sorted(float(x) for x in steps.split(",")))
        if comparison and len(grids[method]) != 1:
            parser.error(f"--grid {spec!r}: --model {args.model} runs one step size per method")
    seeds = SEEDS[:1] if args.quick else SEEDS
    budgets = args.budgets.split(",")
    if not budgets or set(budgets) - {"passes", "seconds"}:
        parser.error(f"--budgets {args.budgets!r}: passes, seconds or both")

    from fgfw.experiments import write_csv

    began = time.perf_counter()
    start, cached = pretrain_cached(task, args.pretrained, args.model, args.quick)
    pretrain_seconds = time.perf_counter() - began
    start_val = task.evaluate(start, "val")[0]
    print(f"{task.name}: pre-trained ({task.pretrain_steps} Adam steps, {pretrain_seconds:.0f} s"
          f"{', loaded from ' + args.pretrained if cached else ''}), validation loss on the new task {start_val:.4f}, "
          f"test loss {task.evaluate(start, 'test')[0]:.4f}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    if comparison:
        name = f"finetune_text_{args.model.replace('-', '_')}_{args.device}{args.suffix}"
        rows = compare(task, start, {m: grids[m][0] for m in methods}, passes, seconds,
                       os.path.join(args.out, f"{name}.csv"),
                       dict(device=args.device, model=args.model + ("-quick" if args.quick else ""),
                            parameters=sum(p.numel() for p in start.parameters()), batch=task.batch_size,
                            length=task.length, pretrain_steps=task.pretrain_steps,
                            pretrain_seconds=round(pretrain_seconds, 1)))
        print_comparison(rows, time.perf_counter() - began)
        return
    ends, curves = [], []
    chosen = {}
    for method in methods:
        scores = []
        for step_size in grids[method]:
            end, _ = fine_tune(task, start, method, step_size, 0, passes=passes)
            ends.append(dict(end, phase="select"))
            scores.append((end["val_loss"], step_size))
            print(f"  select {method} step {step_size:g}: validation loss {end['val_loss']:.4f}", flush=True)
        best = min(scores)[1]
        edge = len(grids[method]) > 1 and best in (grids[method][0], grids[method][-1])
        chosen[method] = (best, edge)
    for method in methods if not args.select_only else ():
        for budget in budgets:
            if budget == "seconds" and "_decay" in method:
                print(f"  {method}: no {seconds:g} s runs (its step decays over a budget of passes)", flush=True)
                continue
            for seed in seeds:
                end, curve = fine_tune(task, start, method, chosen[method][0], seed, test=True,
                                       **{budget: passes if budget == "passes" else seconds})
                ends.append(dict(end, phase=budget, at_grid_edge=chosen[method][1]))
                curves += [dict(point, method=method, seed=seed, budget=budget) for point in curve]
                print(f"  {method} ({budget}) seed {seed}: {end['passes']:.0f} passes, {end['seconds']:.1f} s, test "
                      f"loss {end['test_loss']:.4f}" + (f", accuracy {end['test_accuracy']:.4f}"
                                                        if end.get("test_accuracy") is not None else ""), flush=True)
    os.makedirs(args.figures, exist_ok=True)
    name = f"finetune_{task.name}{args.suffix}"
    write_csv(os.path.join(args.out, f"{name}.csv"), ends)
    if args.select_only:
        for method, (step_size, edge) in chosen.items():
            print(f"chosen: {method} step {step_size:g}{' (at the edge of its grid)' if edge else ''}")
        return
    write_csv(os.path.join(args.out, f"{name}_curves.csv"), curves)
    plot(os.path.join(args.figures, f"{name}.png"), curves, start_val, task.name)
    print_summary(ends, chosen, start_val, time.perf_counter() - began)


def print_summary(ends: list[dict], chosen: dict, start_val: float, took: float) -> None:
    print(f"\nvalidation loss of the pre-trained start on the new task: {start_val:.4f}; {took:.0f} s in all")
    print(f"{'method':<16} {'step':>8} {'budget':<8} {'passes':>8} {'seconds':>8} {'test loss (mean +- sd)':>24} "
          f"{'test acc. %':>14}")
    for method, (step_size, edge) in chosen.items():
        for budget in ("passes", "seconds"):
            runs = [e for e in ends if e["method"] == method and e["phase"] == budget]
            if not runs:  # --budgets left it out
                continue
            losses = [e["test_loss"] for e in runs]
            accs = [100 * e["test_accuracy"] for e in runs if e.get("test_accuracy") is not None]
            spread = lambda v: f"{statistics.fmean(v):.4f} +- {statistics.stdev(v):.4f}" if len(v) > 1 else \
                f"{v[0]:.4f}"  # noqa: E731
            print(f"{method:<16} {step_size:>8g}{'*' if edge else ' '} {budget:<8} "
                  f"{statistics.fmean(e['passes'] for e in runs):8.0f} {statistics.fmean(e['seconds'] for e in runs):8.1f} "
                  f"{spread(losses):>24} {spread(accs) if accs else '':>14}")
    print("* the chosen step size is at the edge of its grid")


def print_comparison(rows: list[dict], took: float) -> None:
    first = rows[0]
    print(f"\n{first['model']} on {first['device']}: {first['parameters']:,} parameters, batch {first['batch']} x "
          f"{first['length']}, {first['pretrain_steps']} Adam steps of pre-training ({first['pretrain_seconds']} s); "
          f"test loss of the start {first['test_loss_start']:.4f}; {took:.0f} s in all")
    print("| method | step | passes | ms per step | ms per pass | x MeZO | peak MiB | x MeZO | test loss |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    ratio = lambda v: "" if v is None else f"{v:.2f}"  # noqa: E731
    for r in rows:
        print(f"| {r['method']} | {r['step_size']:g} | {r['passes']:.0f} | {r['ms_per_step']:.1f} | "
              f"{r['ms_per_pass']:.1f} | {ratio(r['time_vs_mezo'])} | {r['peak_mib']:.1f} | "
              f"{ratio(r['memory_vs_mezo'])} | {r['test_loss']:.4f} |")


def plot(path: str, curves: list[dict], start_val: float, name: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for ax, budget, key, label in ((axes[0], "passes", "passes", "forward passes"),
                                   (axes[1], "seconds", "seconds", "training seconds (1 thread, shared CPU)")):
        for method in dict.fromkeys(c["method"] for c in curves):
            for seed in dict.fromkeys(c["seed"] for c in curves):
                points = [c for c in curves if c["method"] == method and c["budget"] == budget and c["seed"] == seed]
                ax.plot([p[key] for p in points], [p["val_loss"] for p in points], color=f"C{METHODS.index(method)}",
                        alpha=0.8, lw=1.2, label=method if seed == 0 else None)
        ax.axhline(start_val, color="k", ls=":", lw=1, label="pre-trained start")
        ax.set(xlabel=label, ylabel="validation loss", yscale="log", title=f"{name}: equal {label.split(' (')[0]}")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    main()
