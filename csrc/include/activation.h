// The activations fused into the normalize and input-gradient kernels, for host and device code.
//
// A fused layer computes y = act(z) with z = (x - mean) * invstd * weight + bias in the acc dtype
// and rounds once to the storage dtype. Its backward recomputes z from the saved input (no
// activation input is stored) and uses dz = dy * act'(z) where plain BatchNorm uses dy.
//
// The kinds are numbered as ACTIVATIONS in syncbn_lightning/activation.py; `param` is the negative
// slope of leaky_relu and unused by the others. Derivatives at the kinks follow torch's backward
// kernels (relu and leaky_relu take the z <= 0 side at 0, hardswish the outer pieces at +-3, relu6
// 0 at 0 and 6).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "host_device.h"

namespace syncbn {

enum class ActKind : int64_t {
  kIdentity = 0,
  kRelu = 1,
  kLeakyRelu = 2,
  kSilu = 3,
  kHardswish = 4,
  kGelu = 5,  // exact (erf) form, torch's approximate="none"
  kRelu6 = 6,
};
constexpr int64_t kActKinds = 7;

// The activation of a fused layer, as the operators receive it.
struct Activation {
  int64_t kind = 0;
  double param = 0;
  bool identity() const { return kind == static_cast<int64_t>(ActKind::kIdentity); }
};

// No activation: the plain BatchNorm kernels, which the compiler keeps free of activation code.
struct IdentityAct {
  static constexpr bool kIdentity = true;
  template <typename T>
  SYNCBN_HOST_DEVICE T forward(T z) const {
    return z;
  }
  template <typename T>
  SYNCBN_HOST_DEVICE T grad(T) const {
    return T(1);
  }
  template <int N, typename T>
  SYNCBN_HOST_DEVICE void forward_n(T*) const {}
  template <int N, typename T>
  SYNCBN_HOST_DEVICE void grad_n(T* z) const {
    for (int i = 0; i < N; ++i) z[i] = T(1);
  }
};

// ReLU known at compile time: the CPU kernels' loops around it vectorize (a run-time kind's switch
// per value keeps them scalar). Same values and kink convention as FusedAct's kRelu.
struct ReluAct {
  static constexpr bool kIdentity = false;
  template <typename T>
  SYNCBN_HOST_DEVICE T forward(T z) const {
    return z > T(0) ? z : T(0);
  }
  template <typename T>
  SYNCBN_HOST_DEVICE T grad(T z) const {
    return z > T(0) ? T(1) : T(0);
  }
  template <int N, typename T>
  SYNCBN_HOST_DEVICE void forward_n(T* z) const {
    for (int i = 0; i < N; ++i) z[i] = forward(z[i]);
  }
  template <int N, typename T>
  SYNCBN_HOST_DEVICE void grad_n(T* z) const {
    for (int i = 0; i < N; ++i) z[i] = grad(z[i]);
  }
};

// Any other kind, chosen at run time: one kernel per dtype serves every activation. The branch is
// uniform across a launch (no divergence); vectorized kernels take it once per vector of values
// (forward_n, grad_n), so that the unrolled loops around it keep their loads in flight.
template <typename acc_t>
struct FusedAct {
  static constexpr bool kIdentity = false;
  int64_t kind;
  acc_t slope;

  SYNCBN_HOST_DEVICE acc_t forward(acc_t z) const {
    return forward_as(static_cast<ActKind>(kind), z);
  }
  // d act / dz at z.
  SYNCBN_HOST_DEVICE acc_t grad(acc_t z) const { return grad_as(static_cast<ActKind>(kind), z); }

  // forward / grad of N values in place, branching on the kind once for all of them: a branch per
  // value would cut the unrolled loops of the vectorized kernels into short serial pieces.
  template <int N>
  SYNCBN_HOST_DEVICE void forward_n(acc_t* z) const {
    apply_n<N, true>(z);
  }
  template <int N>
  SYNCBN_HOST_DEVICE void grad_n(acc_t* z) const {
    apply_n<N, false>(z);
  }

 private:
  // The one switch over the kinds that the vectorized kernels take: forward (kForward) or grad of
  // N values.
  template <int N, bool kForward>
  SYNCBN_HOST_DEVICE void apply_n(acc_t* z) const {
    switch (static_cast<ActKind>(kind)) {
      case ActKind::kRelu: return map_n<N, ActKind::kRelu, kForward>(z);
      case ActKind::kLeakyRelu: return map_n<N, ActKind::kLeakyRelu, kForward>(z);
      case ActKind::kSilu: return map_n<N, ActKind::kSilu, kForward>(z);
      case ActKind::kHardswish: return map_n<N, ActKind::kHardswish, kForward>(z);
      case ActKind::kGelu: return map_n<N, ActKind::kGelu, kForward>(z);
      case ActKind::kRelu6: return map_n<N, ActKind::kRelu6, kForward>(z);
      default:  // the identity: z itself, or a derivative of 1
        if constexpr (!kForward) {
          for (int i = 0; i < N; ++i) z[i] = acc_t(1);
        }
    }
  }

  template <int N, ActKind K, bool kForward>
  SYNCBN_HOST_DEVICE void map_n(acc_t* z) const {
#ifdef __CUDACC__
#pragma unroll
#endif
    for (int i = 0; i < N; ++i) z[i] = kForward ? forward_as(K, z[i]) : grad_as(K, z[i]);
  }

  SYNCBN_HOST_DEVICE static acc_t sigmoid(acc_t z) { return acc_t(1) / (acc_t(1) + std::exp(-z)); }

  SYNCBN_HOST_DEVICE acc_t forward_as(ActKind k, acc_t z) const {
    switch (k) {
      case ActKind::kRelu:
        return z > acc_t(0) ? z : acc_t(0);
      case ActKind::kLeakyRelu:
        return z > acc_t(0) ? z : z * slope;
      case ActKind::kSilu:
        return z * sigmoid(z);
      case ActKind::kHardswish: {
        const acc_t r = z + acc_t(3);
        const acc_t clamped = r < acc_t(0) ? acc_t(0) : (r > acc_t(6) ? acc_t(6) : r);
        return z * clamped / acc_t(6);
      }
      case ActKind::kGelu:
        return acc_t(0.5) * z * (acc_t(1) + std::erf(z * acc_t(0.70710678118654752440)));
      case ActKind::kRelu6:
        return z > acc_t(0) ? (z < acc_t(6) ? z : acc_t(6)) : acc_t(0);
      default:
        return z;
    }
  }

  SYNCBN_HOST_DEVICE acc_t grad_as(ActKind k, acc_t z) const {
    switch (k) {
      case ActKind::kRelu:
        return z > acc_t(0) ? acc_t(1) : acc_t(0);
      case ActKind::kLeakyRelu:
        return z > acc_t(0) ? acc_t(1) : slope;
      case ActKind::kSilu: {
        const acc_t s = sigmoid(z);
        return s * (acc_t(1) + z * (acc_t(1) - s));
      }
      case ActKind::kHardswish:
        return z <= acc_t(-3) ? acc_t(0) : (z < acc_t(3) ? z / acc_t(3) + acc_t(0.5) : acc_t(1));
      case ActKind::kGelu: {
        const acc_t cdf = acc_t(0.5) * (acc_t(1) + std::erf(z * acc_t(0.70710678118654752440)));
        const acc_t pdf = std::exp(acc_t(-0.5) * z * z) * acc_t(0.39894228040143267794);
        return cdf + z * pdf;
      }
      case ActKind::kRelu6:
        return z > acc_t(0) && z < acc_t(6) ? acc_t(1) : acc_t(0);
      default:
        return acc_t(1);
    }
  }
};

// dy * act'(z). For ReLU a select (z > 0 ? dy : 0, torch's threshold_backward): GCC vectorizes
// it, where dy * (z > 0 ? 1 : 0) compiled to a branch per value (15x slower on random data).
template <typename Act, typename T>
SYNCBN_HOST_DEVICE T times_grad(const Act& act, T dy, T z) {
  if constexpr (std::is_same_v<Act, ReluAct>) {
    return z > T(0) ? dy : T(0);
  } else {
    return dy * static_cast<T>(act.grad(z));
  }
}

// dy * act'(z) with z = xmu * scale + shift: the gradient at the activation's input, which the
// backward kernels use wherever plain BatchNorm uses dy (dy itself without an activation, where
// scale and shift are never read).
template <typename Act, typename T>
SYNCBN_HOST_DEVICE T act_input_grad(const Act& act, T dy, T xmu, T scale, T shift) {
  if constexpr (Act::kIdentity) {
    return dy;
  } else {
    return times_grad(act, dy, xmu * scale + shift);
  }
}

// Calls fn(IdentityAct{}) or fn(FusedAct<acc_t>{...}): the two instantiations every kernel with a
// fused activation has.
template <typename acc_t, typename Fn>
void with_activation(const Activation& act, Fn&& fn) {
  if (act.identity()) {
    fn(IdentityAct{});
  } else {
    fn(FusedAct<acc_t>{act.kind, static_cast<acc_t>(act.param)});
  }
}

// with_activation for the CPU kernels: ReLU, the common case (ResNets), as ReluAct, so that the
// compiler vectorizes it; the other kinds as FusedAct.
template <typename acc_t, typename Fn>
void with_cpu_activation(const Activation& act, Fn&& fn) {
  if (act.kind == static_cast<int64_t>(ActKind::kRelu)) {
    fn(ReluAct{});
  } else {
    with_activation<acc_t>(act, fn);
  }
}

}  // namespace syncbn
