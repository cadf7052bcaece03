// 16-byte access to rows of any storage type, for every kernel file (kernels/mod.rs appends
// this file to the prelude; the CPU emulators of tests/decode_emu and tests/gemv_emu include it
// beside their stand-ins for the prelude's Acc, ldf and stf): Vec16<T>::n elements a 16-byte
// chunk, whether rows of d elements at some pointers can be read so (vec16), and one chunk
// loaded into (ld16) or stored from (st16) the arithmetic type. Also swiglu's sigmoid, which
// rows.cu and gemv.cu's prologue both compute.
template <typename T> struct Vec16 { static const int n = 16 / sizeof(T); };
template <typename T> union Pack16 {
  uint4 u;
  T e[Vec16<T>::n];
};
// Whether rows of d elements at these pointers can be read 16 bytes at a time.
template <typename T>
__device__ __forceinline__ bool vec16(i64 d, const void* a, const void* b, const void* c, const void* e) {
  const unsigned long long m = (unsigned long long)a | (unsigned long long)b | (unsigned long long)c |
                               (unsigned long long)e;
  return d % Vec16<T>::n == 0 && (m & 15) == 0;
}
template <typename T>
__device__ __forceinline__ void ld16(const T* p, typename Acc<T>::t* a) {
  Pack16<T> k;
  k.u = *reinterpret_cast<const uint4*>(p);
#pragma unroll
  for (int i = 0; i < Vec16<T>::n; ++i) a[i] = ldf(k.e[i]);
}
template <typename T>
__device__ __forceinline__ void st16(T* p, const typename Acc<T>::t* a) {
  Pack16<T> k;
#pragma unroll
  for (int i = 0; i < Vec16<T>::n; ++i) stf(&k.e[i], a[i]);
  *reinterpret_cast<uint4*>(p) = k.u;
}
// The sigmoid of swiglu's gate in the arithmetic type; for 2-byte storage types the fast
// exponential and reciprocal, whose error (a few f32 ulps) is far below the result's resolution.
template <typename T>
__device__ __forceinline__ typename Acc<T>::t sigmoid_(typename Acc<T>::t g) {
  typedef typename Acc<T>::t A;
  if constexpr (sizeof(T) == 2) {
    return __frcp_rn(1.0f + __expf(-g));
  } else {
    return (A)1 / ((A)1 + ex_(-g));
  }
}
