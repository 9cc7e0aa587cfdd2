// The softmax's exp(x) = 2^n exp(r), n = round(x / ln 2), r = x - n ln 2 in
// [-ln 2 / 2, ln 2 / 2]: its constants, shared by the portable loop and the
// AVX2 and AVX-512 ones so that every kernel level computes the same
// polynomial.
#ifndef MHA_ENGINE_OPS_EXP_POLYNOMIAL_H_
#define MHA_ENGINE_OPS_EXP_POLYNOMIAL_H_

namespace mha::exp_polynomial {

inline constexpr float kLog2e = 1.44269504f;
// ln 2 in two parts: n * kLn2High is exact for |n| < 2^15.
inline constexpr float kLn2High = 0.693359375f;
inline constexpr float kLn2Low = -2.12194440e-4f;
// ~2 ulp: p = kAccurate in Horner's form, then exp(r) = p r^2 + r + 1.
inline constexpr float kAccurate[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                      4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
// ~4e-6 relative (fitted to exp on the interval), for probabilities rounded
// to bf16: exp(r) = kBf16 in Horner's form.
inline constexpr float kBf16[] = {4.15898298e-2f, 1.67906357e-1f, 5.00022231e-1f, 9.99963654e-1f,
                                  1.0f};

// 2^f for f in [-1/2, 1/2], ~3e-6 relative (fitted), in Horner's form: the
// one-pass bf16 attention's exp, which works in base 2 (scores scaled by
// log2 e once, then 2^(x - max) = 2^n 2^f with no ln 2 reduction).
inline constexpr float kExp2Bf16[] = {9.570101276e-03f, 5.591785908e-02f, 2.402474433e-01f,
                                      6.931217909e-01f, 9.999992847e-01f};

}  // namespace mha::exp_polynomial

#endif  // MHA_ENGINE_OPS_EXP_POLYNOMIAL_H_
