// Upper bounds on every size a config or a batch may give the native core, checked before any
// table or arena is built. zoo/arch/config.py and zoo/train/config.py read them (_native.limits), so
// Python refuses a config before it reaches here, and a caller of the bindings is refused here.
//
// Each bound is far above every real model of the families zoo reads (the largest open ones have
// 126 layers, d_model 16384, MLPs 73728 wide, vocabularies of 262144, contexts of 131072 to 10^6),
// and low enough that every int the kernels index with stays far inside 32 bits and every size in
// floats inside 64 bits.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>

namespace zoo::limits {

constexpr int64_t max_layers = 1024;
// d_model, d_ff, head_dim, n_head, n_kv_head (the widest MLP of an open model is 73728).
constexpr int64_t max_width = 1 << 17;
// The width of one activation row: qkv_dim (n_head + 2 n_kv_head) x head_dim, attn_dim, the MLP's
// gate_width x d_ff. The kernels index within a row with int.
constexpr int64_t max_row_floats = 1 << 20;
constexpr int64_t max_vocab = 1 << 24;
constexpr int64_t max_seq_len = 1 << 21;
// One weight tensor (vocab x d_model, the MLP's matrices, learned positions x d_model): 2^36
// floats is 256 GiB, 30 times the largest embedding of an open model.
constexpr int64_t max_tensor_floats = int64_t(1) << 36;
// Tokens per micro-batch (B x T): the kernels count rows with int (N = B * T) and form N x width
// in 64 bits; 2^24 is 16.7M tokens, above the global batch of the largest pretraining runs, and
// 2^24 x max_row_floats stays inside 2^44. A product of 2^31 or more used to wrap (SIGFPE).
constexpr int64_t max_tokens = 1 << 24;

// Throws std::invalid_argument naming the field if value is outside [1, bound].
inline void check_size(const char* field, int64_t value, int64_t bound) {
    if (value < 1 || value > bound)
        throw std::invalid_argument(std::string("zoo: ") + field + " = " + std::to_string(value) +
                                    (value < 1 ? " must be positive" : " is above zoo's bound of " +
                                                                           std::to_string(bound)));
}

// A micro-batch shape (B, T): each positive, T within max_seq_len, B x T within max_tokens.
// what names the call (a binding, a planner) for the message.
inline void check_batch(int64_t B, int64_t T, const char* what) {
    if (B < 1 || T < 1)
        throw std::invalid_argument(std::string("zoo: ") + what + ": batch size " + std::to_string(B) +
                                    " and sequence length " + std::to_string(T) + " must be positive");
    if (T > max_seq_len || B > max_tokens || B * T > max_tokens)
        throw std::invalid_argument(std::string("zoo: ") + what + ": batch size " + std::to_string(B) +
                                    " x sequence length " + std::to_string(T) + " is above zoo's bound of " +
                                    std::to_string(max_tokens) + " tokens per micro-batch");
}

// The product of sizes, in floats, for a buffer whose factors the bounds above do not keep
// small enough together (n_head x T^2); throws, naming it, past 2^48 floats (1 PiB).
inline uint64_t product_floats(const char* what, std::initializer_list<uint64_t> factors) {
    uint64_t p = 1;
    for (uint64_t f : factors)
        if (__builtin_mul_overflow(p, f, &p) || p > (uint64_t(1) << 48))
            throw std::invalid_argument(std::string("zoo: ") + what + " would take more than 2^48 floats");
    return p;
}

}  // namespace zoo::limits
