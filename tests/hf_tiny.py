"""Tiny random checkpoints that transformers itself writes, with tokenizers, for end-to-end tests.

GPT-2: a byte-level BPE (vocab.json + merges.txt) trained here on the start of the data.
Llama: the Llama-2 SentencePiece tokenizer from shared data (32000 ids), tied embeddings.
"""

import shutil
from pathlib import Path

import numpy as np

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
if not SHARED.is_dir():
    SHARED = Path("/work/shared/data")
SHAKESPEARE = SHARED / "tinyshakespeare.txt"
LLAMA2_TOKENIZER = SHARED / "llama2-tokenizer.model"


def gpt2_checkpoint(folder: Path, text: str, vocab_size: int = 384, n_positions: int = 128) -> Path:
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text[:200_000]], trainer)
    eos = tok.token_to_id("<|endoftext|>")
    cfg = transformers.GPT2Config(vocab_size=tok.get_vocab_size(), n_positions=n_positions, n_embd=64, n_layer=2,
                                  n_head=4, bos_token_id=eos, eos_token_id=eos)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(folder)
    tok.model.save(str(folder))  # vocab.json + merges.txt, GPT-2's own files
    return folder


def llama_checkpoint(folder: Path) -> Path:
    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    shutil.copy(LLAMA2_TOKENIZER, folder / "tokenizer.model")
    return folder


def hf_logits(folder: Path, tokens: np.ndarray) -> np.ndarray:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
