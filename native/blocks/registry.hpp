// The block registry: every block kind zoo has, listed once. A config names its norm and its
// MLP activation; the executor looks them up here, Python learns them from build_info(), and
// the Clad translation unit compiles every block's generated pullback by including this file.
// A new norm or activation: its header in native/blocks/ (forward, pullback, registry entry) and
// its entry in the list below (docs/adding_a_block.md); the build includes every header there.
#pragma once
#include <stdexcept>
#include <string>
#include <vector>

#include "block_headers.hpp"  // every header in native/blocks/, listed by CMakeLists.txt

namespace zoo {

inline const NormBlock* const norm_blocks[] = {&layernorm_block, &rmsnorm_block, &layernorm_nobias_block,
                                               &rmsnorm_1p_block};
inline const ActivationBlock* const activation_blocks[] = {&gelu_block, &swiglu_block, &relu2_block, &geglu_block,
                                                           &gelu_erf_block};

// Every block by the name ad= takes, with the pullbacks this build has for it.
struct BlockInfo {
    std::string name, kind;  // kind: "norm", "mlp" (chosen by the config) or "fixed" (every model)
    bool manual, clad, in_step;
};

inline std::vector<BlockInfo> block_infos() {
    std::vector<BlockInfo> out;
    auto fixed = [&](const auto& b) {
        out.push_back({b.name, "fixed", b.pullback != nullptr, b.pullback_clad != nullptr, b.in_step});
    };
    fixed(embedding_block);
    fixed(rope_block);
    for (const NormBlock* n : norm_blocks)
        out.push_back({n->name, "norm", n->pullback != nullptr, n->pullback_clad != nullptr, true});
    for (const ActivationBlock* a : activation_blocks)
        out.push_back({a->name, "mlp", a->pullback != nullptr, a->pullback_clad != nullptr, true});
    fixed(linear_block);
    fixed(lora_block);
    fixed(attention_block);
    fixed(residual_block);
    fixed(cross_entropy_block);
    return out;
}

template <class Block, size_t K>
const Block& find_block(const Block* const (&blocks)[K], const std::string& name, const char* field) {
    std::string names;
    for (const Block* b : blocks) {
        if (name == b->name) return *b;
        names += (names.empty() ? "" : ", ") + std::string(b->name);
    }
    throw std::invalid_argument(std::string("zoo: ") + field + "='" + name + "' is no registered block; registered: " +
                                names);
}
inline const NormBlock& find_norm(const std::string& name) { return find_block(norm_blocks, name, "norm"); }
inline const ActivationBlock& find_activation(const std::string& name) {
    return find_block(activation_blocks, name, "mlp");
}

}  // namespace zoo
