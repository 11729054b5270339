// CUDA kernels of the backward (see syncbn.h for the maths): the local reductions (sum_dy,
// sum_dy_xmu) through the two-stage reduction (cuda_reduce.cuh) and the elementwise input
// gradient (cuda_elemt.cuh), each with an optional fused activation (dy * act'(z) in place of dy).
// Layout of this file: the kernels' Ops, dispatch.
#include "cuda_elemt.cuh"
#include "cuda_reduce.cuh"
#include "grad_header.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAGuard.h>

#include <type_traits>

namespace syncbn {
namespace {

// ------------------------------------------------------------------------------------------------
// Device helpers
// ------------------------------------------------------------------------------------------------

// A channel's mean and, for a fused activation, the coefficients of z = (x - mean) * scale + shift
// (with a split mean, shift includes - mean_lo * scale).
template <typename acc_t>
struct ZChannel {
  acc_t mean, scale, shift;
};

// Per-channel backward sums: fields (sum dy, sum dy * xmu), xmu = (x - mean) - mean_lo; with a
// fused activation, dy * act'(z) in place of dy (activation.h), z recomputed from x. The loop
// sums dy * (x - mean); the low part of a split mean is applied once per channel at the end
// (sum dy * xmu = sum dy * (x - mean) - mean_lo * sum dy), so the loop's registers stay as they
// are without it.
template <typename scalar_t, typename acc_t, typename Act = IdentityAct>
struct GradSumOp {
  static constexpr int kFields = 2;
  using scalar_type = scalar_t;
  struct Item {
    acc_t dy, x;
  };
  using Channel = ZChannel<acc_t>;
  const scalar_t* __restrict__ dy;
  const scalar_t* __restrict__ x;
  const acc_t* __restrict__ mean;
  const acc_t* __restrict__ mean_lo;  // may be null: 0
  // Read only with an activation (weight and bias may be null: 1 and 0).
  const acc_t* __restrict__ invstd = nullptr;
  const acc_t* __restrict__ weight = nullptr;
  const acc_t* __restrict__ bias = nullptr;
  Act act = {};
  // The call-order header in front of the sums (may be null), written from the call's tags
  // (grad_info[4..5]; null: zeros) by the thread that writes channel 0.
  const acc_t* __restrict__ tags = nullptr;
  acc_t* __restrict__ header = nullptr;

  __device__ Channel channel(int64_t c) const {
    if constexpr (Act::kIdentity) {
      return {mean[c], acc_t(0), acc_t(0)};
    } else {
      const acc_t scale = invstd[c] * (weight ? weight[c] : acc_t(1));
      const acc_t shift = bias ? bias[c] : acc_t(0);
      return {mean[c], scale, mean_lo ? shift - mean_lo[c] * scale : shift};
    }
  }
  bool aligned(size_t bytes) const { return aligned_to(dy, bytes) && aligned_to(x, bytes); }
  __device__ __forceinline__ Item load(int64_t i, Channel) const {
    return {to_acc<acc_t>(dy[i]), to_acc<acc_t>(x[i])};
  }
  template <int VEC>
  __device__ __forceinline__ void load_vec(int64_t i, const Channel*, Item* v) const {
    const Vec<scalar_t, VEC> rdy = syncbn::load_vec<VEC>(dy, i);
    const Vec<scalar_t, VEC> rx = syncbn::load_vec<VEC>(x, i);
#pragma unroll
    for (int e = 0; e < VEC; ++e) v[e] = {to_acc<acc_t>(rdy.v[e]), to_acc<acc_t>(rx.v[e])};
  }
  // dy * act'(z) (dy without an activation) for N items, the activation's branch taken once.
  template <int N>
  __device__ __forceinline__ void input_grads(
      const Item* v, const Channel* ch, int ch_step, acc_t* dz, acc_t* xm) const {
    acc_t g[N];
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const Channel& c = ch[i * ch_step];
      xm[i] = v[i].x - c.mean;
      g[i] = xm[i] * c.scale + c.shift;
    }
    if constexpr (!Act::kIdentity) act.template grad_n<N>(g);
#pragma unroll
    for (int i = 0; i < N; ++i) dz[i] = Act::kIdentity ? v[i].dy : v[i].dy * g[i];
  }
  __device__ __forceinline__ void push(acc_t* s, Item v, const Channel& ch) const {
    push_run<1>(s, &v, 1, ch);
  }
  // The first `count` of N items of one channel.
  template <int N>
  __device__ __forceinline__ void push_run(
      acc_t* s, const Item* v, int count, const Channel& ch) const {
    acc_t dz[N], xm[N];
    input_grads<N>(v, &ch, 0, dz, xm);
#pragma unroll
    for (int u = 0; u < N; ++u) {
      if (u < count) {
        s[0] += dz[u];
        s[1] += dz[u] * xm[u];
      }
    }
  }
  template <int VEC>
  __device__ __forceinline__ void push_vec(
      acc_t (*s)[kFields], const Item* v, const Channel* ch) const {
    acc_t dz[VEC], xm[VEC];
    input_grads<VEC>(v, ch, 1, dz, xm);
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      s[e][0] += dz[e];
      s[e][1] += dz[e] * xm[e];
    }
  }
  template <typename T>
  __device__ __forceinline__ static void combine(T* a, const T* b) {
    a[0] += b[0];
    a[1] += b[1];
  }
  // (sum dy, sum dy * xmu).
  template <typename T>
  __device__ __forceinline__ void outputs(
      const T* s, Channel, int64_t c, const Outputs<acc_t>& out) const {
    const T lo = mean_lo ? static_cast<T>(mean_lo[c]) : T(0);
    out.out0[c] = static_cast<acc_t>(s[0]);
    out.out1[c] = static_cast<acc_t>(lo == T(0) ? s[1] : s[1] - lo * s[0]);
    if (header != nullptr && c == 0) {
      write_grad_header(tags ? double(tags[0]) : 0.0, tags ? double(tags[1]) : 0.0, header);
    }
  }
};

// GradSumOp of a layer whose forward added a residual before its activation, y = act(z + r): each
// element is loaded as g = dy * act'(z + r), rounded to scalar_t and written to `grad` (the
// residual's gradient, and grad_input's dy), and GradSumOp without an activation sums that g. A
// reduction loads every element exactly once, so `grad` is written whole.
template <typename scalar_t, typename acc_t, typename Act>
struct GradSumResidualOp : GradSumOp<scalar_t, acc_t, IdentityAct> {
  using Base = GradSumOp<scalar_t, acc_t, IdentityAct>;
  using Item = typename Base::Item;
  using Channel = typename Base::Channel;
  const scalar_t* __restrict__ residual = nullptr;
  scalar_t* __restrict__ grad = nullptr;
  Act act = {};

  // The forward's z coefficients (the identity's are never read).
  __device__ Channel channel(int64_t c) const {
    if constexpr (Act::kIdentity) {
      return {this->mean[c], acc_t(0), acc_t(0)};
    } else {
      const acc_t scale = this->invstd[c] * (this->weight ? this->weight[c] : acc_t(1));
      const acc_t shift = this->bias ? this->bias[c] : acc_t(0);
      return {this->mean[c], scale, this->mean_lo ? shift - this->mean_lo[c] * scale : shift};
    }
  }
  bool aligned(size_t bytes) const {
    return Base::aligned(bytes) && aligned_to(residual, bytes) && aligned_to(grad, bytes);
  }
  __device__ __forceinline__ Item load(int64_t i, Channel ch) const {
    acc_t z[1] = {(to_acc<acc_t>(this->x[i]) - ch.mean) * ch.scale + ch.shift +
                  to_acc<acc_t>(residual[i])};
    act.template grad_n<1>(z);
    const scalar_t g = static_cast<scalar_t>(to_acc<acc_t>(this->dy[i]) * z[0]);
    grad[i] = g;
    return {to_acc<acc_t>(g), to_acc<acc_t>(this->x[i])};
  }
  template <int VEC>
  __device__ __forceinline__ void load_vec(int64_t i, const Channel* ch, Item* v) const {
    const Vec<scalar_t, VEC> rdy = syncbn::load_vec<VEC>(this->dy, i);
    const Vec<scalar_t, VEC> rx = syncbn::load_vec<VEC>(this->x, i);
    const Vec<scalar_t, VEC> rr = syncbn::load_vec<VEC>(residual, i);
    acc_t z[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      z[e] = (to_acc<acc_t>(rx.v[e]) - ch[e].mean) * ch[e].scale + ch[e].shift +
             to_acc<acc_t>(rr.v[e]);
    }
    act.template grad_n<VEC>(z);
    Vec<scalar_t, VEC> out;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      out.v[e] = static_cast<scalar_t>(to_acc<acc_t>(rdy.v[e]) * z[e]);
      v[e] = {to_acc<acc_t>(out.v[e]), to_acc<acc_t>(rx.v[e])};
    }
    *reinterpret_cast<Vec<scalar_t, VEC>*>(grad + i) = out;
  }
};

// dx = (dy - mean_dy - xmu * k) * iw with xmu = (x - mean) - mean_lo, mean_dy = sum_dy / n, k =
// sum_dy_xmu / n * invstd^2 and iw = invstd * weight, where n is the group count read from device
// memory. (x - mean) stays explicit: folding the mean into an offset cancels catastrophically for
// large means; the low part of a split mean, small, joins the per-channel constants instead
// (mean_dy - mean_lo * k, and the activation's shift - mean_lo * iw), so a thread holds no more
// coefficients than without it.
// With a fused activation dy * act'(z) stands for dy, z = (x - mean) * iw + bias as in the forward.
template <typename acc_t, typename Act = IdentityAct>
struct BackwardElemtOp {
  static constexpr int kInputs = 2;  // dy, x
  struct Coeff {
    acc_t mean, iw, mean_dy, k, shift;
  };
  const acc_t* __restrict__ mean;
  const acc_t* __restrict__ mean_lo;  // may be null: 0
  const acc_t* __restrict__ invstd;
  const acc_t* __restrict__ weight;  // may be null
  const acc_t* __restrict__ sum_dy;
  const acc_t* __restrict__ sum_dy_xmu;
  const acc_t* __restrict__ count;  // one element
  const acc_t* __restrict__ bias = nullptr;  // read only with an activation (may be null: 0)
  Act act = {};
  acc_t inv_n = acc_t(0);           // 1 / count, set by begin()
  // The backward's call-order check (grad_input; order_ok may be null: none), made by the grid's
  // first thread: the summed header against `ranks` times the header of the call's tags.
  const acc_t* __restrict__ header = nullptr;
  const acc_t* __restrict__ tags = nullptr;
  double ranks = 0;
  acc_t* __restrict__ order_ok = nullptr;

  // Once per thread, before coeff(): one read of the group count and one division, instead of
  // an FP64 division and three FP64 multiplies per element (1/32-1/64 rate on many GPUs).
  __device__ __forceinline__ void begin() {
    const acc_t n = count[0];
    inv_n = acc_t(1) / (n > acc_t(1) ? n : acc_t(1));
    if (order_ok != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 &&
        threadIdx.y == 0) {
      *order_ok = grad_header_matches(header, double(tags[0]), double(tags[1]), ranks)
                      ? acc_t(1) : acc_t(0);
    }
  }
  __device__ __forceinline__ Coeff coeff(int64_t c) const {
    const acc_t is = invstd[c];
    const acc_t iw = weight ? is * weight[c] : is;
    const acc_t shift = !Act::kIdentity && bias ? bias[c] : acc_t(0);
    const acc_t k = sum_dy_xmu[c] * inv_n * is * is;
    const acc_t mean_dy = sum_dy[c] * inv_n;
    if (mean_lo == nullptr) return {mean[c], iw, mean_dy, k, shift};
    const acc_t lo = mean_lo[c];
    return {mean[c], iw, mean_dy - lo * k, k, Act::kIdentity ? shift : shift - lo * iw};
  }
  template <int VEC, typename CoeffOf>
  __device__ __forceinline__ void apply_vec(
      CoeffOf coeff_of, const acc_t (*in)[VEC], acc_t* out) const {
    acc_t xm[VEC], g[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const Coeff k = coeff_of(e);
      xm[e] = in[1][e] - k.mean;
      g[e] = xm[e] * k.iw + k.shift;
    }
    if constexpr (!Act::kIdentity) act.template grad_n<VEC>(g);
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const Coeff k = coeff_of(e);
      const acc_t dz = Act::kIdentity ? in[0][e] : in[0][e] * g[e];
      out[e] = (dz - k.mean_dy - xm[e] * k.k) * k.iw;
    }
  }
};

// What the reduction's and the elementwise kernel's first thread do for the header when a batch
// is empty and neither is launched: write it from the tags (header non-null) and check the summed
// one (order_ok non-null).
template <typename acc_t>
__global__ void __launch_bounds__(1) grad_header_kernel(
    const acc_t* tags, acc_t* header, const acc_t* total, double ranks, acc_t* order_ok) {
  const double layer = tags ? double(tags[0]) : 0.0, call = tags ? double(tags[1]) : 0.0;
  if (header != nullptr) write_grad_header(layer, call, header);
  if (order_ok != nullptr) {
    *order_ok = grad_header_matches(total, layer, call, ranks) ? acc_t(1) : acc_t(0);
  }
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// Dispatch: dtype, layout, activation
// ------------------------------------------------------------------------------------------------

namespace detail {

void grad_header_cuda(const GradHeader& h) {
  AT_DISPATCH_FLOATING_TYPES(h.info.scalar_type(), "grad_header_cuda", [&] {
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(h.info.get_device()).stream();
    grad_header_kernel<scalar_t><<<1, 1, 0, stream>>>(
        h.info.const_data_ptr<scalar_t>() + 4, h.header ? h.header->mutable_data_ptr<scalar_t>() : nullptr,
        h.total ? h.total->const_data_ptr<scalar_t>() : nullptr, h.ranks,
        h.order_ok ? h.order_ok->mutable_data_ptr<scalar_t>() : nullptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void backward_sums_into_cuda(const SumsInto& into) {
  const at::Tensor &grad_out = into.grad_out, &input = into.input, &mean = into.mean,
                   &mean_lo = into.mean_lo, &info = into.info, &residual = into.residual;
  const ActAffine& act = into.act;
  at::Tensor *header = into.header, *grad = into.grad;
  at::Tensor &sum_dy = into.sum_dy, &sum_dy_xmu = into.sum_dy_xmu;
  const Geometry g = geometry_of(input);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "backward_reduce_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    with_activation<acc_t>(act.act, [&](const auto& a) {
      using Act = std::decay_t<decltype(a)>;
      const GradSumOp<scalar_t, acc_t, Act> op{
          grad_out.const_data_ptr<scalar_t>(), input.const_data_ptr<scalar_t>(),
          mean.const_data_ptr<acc_t>(), data_or_null<acc_t>(mean_lo),
          data_or_null<acc_t>(act.invstd), data_or_null<acc_t>(act.weight),
          data_or_null<acc_t>(act.bias), a,
          info.defined() ? info.const_data_ptr<acc_t>() + 4 : nullptr,
          header ? header->mutable_data_ptr<acc_t>() : nullptr};
      const Outputs<acc_t> out{
          sum_dy.mutable_data_ptr<acc_t>(), sum_dy_xmu.mutable_data_ptr<acc_t>(), nullptr};
      if (grad == nullptr) {
        launch_reduction(op, g, input, out);
        return;
      }
      // The base's own activation is the identity: it sums the g its loads produce.
      GradSumResidualOp<scalar_t, acc_t, Act> fused{};
      static_cast<GradSumOp<scalar_t, acc_t, IdentityAct>&>(fused) = {
          op.dy, op.x, op.mean, op.mean_lo, op.invstd, op.weight, op.bias, IdentityAct{},
          op.tags, op.header};
      fused.residual = residual.const_data_ptr<scalar_t>();
      fused.grad = grad->mutable_data_ptr<scalar_t>();
      fused.act = a;
      launch_reduction(fused, g, input, out);
    });
  });
}

at::Tensor backward_elemt_act_cuda(
    const at::Tensor& grad_out_, const at::Tensor& input_, const at::Tensor& mean_,
    const at::Tensor& mean_lo_, const at::Tensor& invstd_,
    const c10::optional<at::Tensor>& weight, const at::Tensor& sum_dy_,
    const at::Tensor& sum_dy_xmu_, const at::Tensor& count_, const ActAffine& act,
    const GradHeader* check) {
  const c10::cuda::CUDAGuard guard(input_.device());
  const ElemtOperands o =
      elemt_operands(input_, grad_out_, mean_, mean_lo_, invstd_, weight, c10::nullopt);
  const at::Tensor sum_dy = sum_dy_.contiguous(), sum_dy_xmu = sum_dy_xmu_.contiguous();
  // The count stays on the device (no .item()): the kernel reads it.
  const at::Tensor count = count_.reshape({1}).to(o.mean.scalar_type());
  if (o.input.numel() == 0) {
    if (check != nullptr) grad_header_cuda(*check);
    return o.output;
  }
  const Geometry g = geometry_of(o.input);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, o.input.scalar_type(), "backward_elemt_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const ElemtPointers<scalar_t, 2> ptr{
        {o.grad_out.const_data_ptr<scalar_t>(), o.input.const_data_ptr<scalar_t>()},
        o.output.mutable_data_ptr<scalar_t>()};
    with_activation<acc_t>(act.act, [&](const auto& a) {
      using Op = BackwardElemtOp<acc_t, std::decay_t<decltype(a)>>;
      Op op{
          o.mean.const_data_ptr<acc_t>(),     data_or_null<acc_t>(o.mean_lo),
          o.invstd.const_data_ptr<acc_t>(),   data_or_null<acc_t>(o.weight),
          sum_dy.const_data_ptr<acc_t>(),     sum_dy_xmu.const_data_ptr<acc_t>(),
          count.const_data_ptr<acc_t>(),      data_or_null<acc_t>(act.bias),
          a};
      if (check != nullptr) {
        op.header = check->total->const_data_ptr<acc_t>();
        op.tags = check->info.const_data_ptr<acc_t>() + 4;
        op.ranks = check->ranks;
        op.order_ok = check->order_ok->mutable_data_ptr<acc_t>();
      }
      launch_elemt<Op, scalar_t, acc_t>(op, ptr, g, o.input);
    });
  });
  return o.output;
}

}  // namespace detail
}  // namespace syncbn
