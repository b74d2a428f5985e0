// The one place the fgfw op schemas are defined. Kernels register their implementations with
// TORCH_LIBRARY_IMPL in their own files (cpu/, cuda/); python/fgfw/reference.py is the spec.
#include <torch/library.h>

TORCH_LIBRARY(fgfw, m) {
  // Writes the tangent stream for out's elements (flat order, stream index offset + j).
  // distribution: 0 = Gaussian (Box-Muller, float32), 1 = Rademacher.
  m.def("fill_tangent_(Tensor(a!) out, int seed, int step, int tangent_id, int offset, int distribution) -> ()");
  // The same at the step held by a 0-dim int64 tensor (the optimizers' counter) on out's device, or on
  // the CPU: a GPU kernel reads it there, so a step needs no host read and replays in a CUDA graph.
  m.def("fill_tangent_at_step_(Tensor(a!) out, int seed, Tensor step, int tangent_id, int offset, "
        "int distribution) -> ()");
  // New tensors, one per tensor of likes (its shape, dtype, device and memory format), each filled as
  // fill_tangent_at_step_ fills it with tangent tangent_ids[i] from offsets[i]: the tangents of a layer's
  // parameters (the lean engine's just-in-time tangents), or the K tangents of one parameter, in one
  // dispatch, not an allocation and a fill for each.
  m.def("tangents_at_step(Tensor[] likes, int seed, Tensor step, int[] tangent_ids, int[] offsets, "
        "int distribution) -> Tensor[]");
  // One fused Frank-Wolfe step over L1 ball(s) for a group of same-device, same-dtype tensors.
  // schedule: float64 (step, alpha, gamma) or (step, alpha, gamma, skip) on the params' device, read there (a
  // step with skip != 0 writes nothing but NaN into gap: the optimizers' deferred finite check); tangent_coeffs: float64 [K];
  // grads empty -> forward gradient from the tangent stream; momentum empty -> no momentum;
  // gap: float64 scalar, receives the Frank-Wolfe gap. row_numel: per tensor, 0 (the tensor is one
  // ball) or the length of its row balls (scope "row"); empty = all 0. radii: one per ball, in order.
  m.def(
      "l1_fw_step_(Tensor(a!)[] params, Tensor(b!)[] momentum, Tensor[] grads, Tensor schedule, "
      "Tensor tangent_coeffs, float[] radii, bool global_ball, int[] offsets, int seed, int distribution, "
      "Tensor(c!) gap, int[] row_numel=[]) -> ()");
  // The same step over L-infinity ball(s): the vertex of a ball of radius r is -r sign(d), so the step is
  // one pass with no reduction but the gap's (reference.linf_fw_step_).
  m.def(
      "linf_fw_step_(Tensor(a!)[] params, Tensor(b!)[] momentum, Tensor[] grads, Tensor schedule, "
      "Tensor tangent_coeffs, float[] radii, bool global_ball, int[] offsets, int seed, int distribution, "
      "Tensor(c!) gap, int[] row_numel=[]) -> ()");
  // The same step over Lp ball(s), 1 < p < inf (p = 2: the L2 ball): per ball a reduction pass for max|d| and
  // ||d / max|d| ||_q, then the update pass with s_i = -r sign(d_i) (x_i / ||x||_q)^(q-1)
  // (reference.lp_fw_step_). scales: the norm feedback's state, float64, one per ball of each tensor (one tensor
  // of one element for the global ball), read and written; empty: no feedback (docs/feasibility.md). Every
  // argument is required: a tensor list cannot have a default, nor follow arguments that have one.
  m.def(
      "lp_fw_step_(Tensor(a!)[] params, Tensor(b!)[] momentum, Tensor[] grads, Tensor schedule, "
      "Tensor tangent_coeffs, float[] radii, bool global_ball, int[] offsets, int seed, int distribution, "
      "Tensor(c!) gap, int[] row_numel, float p, Tensor(d!)[] scales) -> ()");
  // The same step over k-sparse polytope(s) of radius r: s = -r sign(d) on the k largest |d| of each ball
  // (ties: lowest index), found by a selection of the k-th largest |d| (reference.ksparse_fw_step_). scales: as
  // lp_fw_step_'s, for ||theta||_1 <= k r.
  m.def(
      "ksparse_fw_step_(Tensor(a!)[] params, Tensor(b!)[] momentum, Tensor[] grads, Tensor schedule, "
      "Tensor tangent_coeffs, float[] radii, bool global_ball, int[] offsets, int seed, int distribution, "
      "Tensor(c!) gap, int[] row_numel, int k, Tensor(d!)[] scales) -> ()");
  // The step of an unconstrained param group (reference.gradient_step_) from given directions (grads): with
  // momentum, v <- (1 - gamma) v + gamma g and d = v, else d = g; then theta <- theta - alpha d, each product and
  // sum rounded in the params' dtype (float32 or float64), in one multi-tensor pass. Skipped as the steps above.
  m.def("gradient_step_(Tensor(a!)[] params, Tensor(b!)[] momentum, Tensor[] grads, Tensor schedule) -> ()");
  // Whether every element of every tensor is finite (the optimizers' check_finite). CPU kernel only.
  m.def("all_finite(Tensor[] tensors) -> bool");
  // Whether some element of some tensor is not finite, as a 0-dim bool tensor on the tensors' (one) device: the
  // check without a host read (CPU and CUDA kernels; one read of each tensor).
  m.def("nonfinite(Tensor[] tensors) -> Tensor");
}
