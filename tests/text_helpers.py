"""A small real tokenizer made in the test session: byte-level BPE trained with `tokenizers` on
text with accented, CJK and emoji characters (so some characters span several tokens), its
special tokens, a chat template and a generation_config with two EOS ids, saved into a
checkpoint folder the way Hugging Face saves them."""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = ["hello world, café au lait", "日本語のテキストです", "emoji 🙂 and a naïve façade", "the cat sat on the mat"] * 20
SPECIALS = ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"]
VOCAB = 280  # the byte alphabet (256) + specials + a few merges
#: a Zephyr-like template: the BOS variable, roles as special tokens, a generation prompt
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


def write_tokenizer(folder: Path, template_file: bool = False) -> dict[str, int]:
    """tokenizer.json, tokenizer_config.json (the chat template inside, or in chat_template.jinja
    as transformers 5 saves it) and generation_config.json into `folder`; returns the special ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer)
    ids = {token: tokenizer.token_to_id(token) for token in SPECIALS}
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", ids["<s>"])])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}
    if template_file:
        (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    else:
        config["chat_template"] = CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [ids["</s>"], ids["<|end|>"]]}))
    return ids


def export_with_tokenizer(root: Path, seed: int = 2, sliding_window: int | None = None):
    """(transformers model, fp32 artifact): a 2-layer Mixtral whose vocabulary covers the
    tokenizer, saved with it into `root`/checkpoint and exported from there by moedeploy. Its
    attention runs on GroupQueryAttention (so the server batches its streams in flight) unless
    it has a sliding window."""
    from moedeploy.export.exporter import export
    from tests.families.cases import _family_config, make_model, save_checkpoint

    config = _family_config("mixtral", 2, head_dim=16, intermediate_size=33, num_local_experts=5,
                            num_experts_per_tok=2, sliding_window=sliding_window, vocab_size=VOCAB + 8,
                            max_position_embeddings=2048)  # room for a generation long enough to abandon
    hf = make_model(config, seed=seed)
    checkpoint = save_checkpoint(hf, root / "checkpoint")
    write_tokenizer(checkpoint)
    return hf, export("decoder", root / "artifact", checkpoint=checkpoint, golden=False)
