"""Build pdserve's tiny embedded Llama model: ``python tinymodel.py OUTDIR``.

Runs in the *engine* venv (torch, transformers, tokenizers), never imports pdserve (whose venv has no
torch). No model hub is reachable: the tokenizer is trained on the fixed text below and the weights come
from a fixed seed, so every build is byte-identical and greedy output is a usable equality oracle.
Weights are float32; serve with ``--dtype float32`` (vLLM CPU would otherwise downcast to bfloat16).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# mypy runs in the pdserve venv, which lacks these; "unused-ignore" keeps it clean where they exist.
import torch  # type: ignore[import-not-found,unused-ignore]
from tokenizers import (  # type: ignore[import-not-found,unused-ignore]
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import (  # type: ignore[import-not-found,unused-ignore]
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

SEED = 20240601
VOCAB_SIZE = 2000  # an upper bound: the trainer stops early if the text runs out of merges
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]  # ids 0..3, in this order
MAX_LEN = 4096

# Role lines end with </s>, so a finished turn looks like a finished completion; the generation prompt
# leaves the model after "assistant:". Unknown roles are rendered as they are rather than rejected.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

# Fixed training text (original prose, a few KB): enough merges for a ~2k vocabulary of common words.
CORPUS = """\
The morning train left the station a few minutes after seven. Most of the passengers were going to work,
and they read the news, drank coffee from paper cups, or looked out of the window at the fields. A small
child asked her father why the trees seemed to run backwards, and he explained that it was the train
that moved, not the trees. She thought about this for a long time and then said that she did not believe it.

A good cook knows that bread needs time. Flour, water, salt and yeast are mixed into a soft dough, which
is left to rest in a warm place until it has doubled in size. Then the dough is shaped, left to rise a
second time, and baked in a hot oven until the crust is brown and the loaf sounds hollow when you tap it.
The smell of fresh bread fills the whole house and brings everyone into the kitchen.

Computers store numbers as patterns of bits. A program is a list of instructions that tells the machine
what to do with those numbers: add them, compare them, move them from one place in memory to another.
When many programs share one machine, the operating system decides which of them runs next, how much
memory each may use, and which files each is allowed to read or write. Servers answer requests from
clients over the network; a request arrives, the server does some work, and it sends back a response.
Large language models predict the next token of a text. During prefill the model reads the whole prompt
at once and fills its key and value cache; during decode it produces one new token at a time, reading
that cache again for every step. Splitting the two phases across separate machines lets each one be
sized and scheduled for the kind of work it does best.

In the spring the river rose and covered the low meadows. Farmers moved their sheep to higher ground and
waited for the water to go down. When it did, the soil was dark and rich, and the grass grew faster than
in any other year. The old people in the village said that a flood was a gift as well as a danger, and
that the fields remembered the river long after the river had forgotten the fields.

Please tell me the time. What is your name? Where do you live, and how long have you lived there? I would
like a cup of tea with milk and no sugar, thank you. Could you help me find the library? It is on the
corner of the main street, next to the bank and across from the small park with the fountain.

The history of mathematics is full of simple questions that took centuries to answer. How many prime
numbers are there? Euclid showed that there is no largest prime: multiply all the primes you know, add
one, and the result has a prime factor that was not on your list. Other questions are still open, and
students everywhere try their hand at them, armed with paper, pencils, and a great deal of patience.

Weather changes quickly near the mountains. A clear blue sky can fill with clouds in less than an hour,
and a warm afternoon can end in snow. Walkers are told to carry a map, a warm coat, water, and something
to eat, and to tell a friend which path they plan to take and when they expect to return home again.

Music is organised sound. A melody is a line of notes that rise and fall; harmony is what happens when
several notes sound together; rhythm is the pattern of long and short sounds in time. Children learn songs
long before they learn to read, and many people can remember the words of a song they have not heard for
twenty years, even when they cannot remember what they had for breakfast this morning.

Gardening teaches patience and humility. Tomatoes want sunshine, beans climb anything tall, and lettuce
bolts the moment summer heat arrives. Slugs devour seedlings overnight; blackbirds steal ripe cherries;
squirrels bury acorns then forget them, planting accidental oak forests across suburban lawns.

Physicists describe motion using velocity, acceleration, momentum and energy. Galileo rolled polished
bronze spheres down inclined wooden ramps, timing them against dripping water, and discovered that distance
grows with the square of elapsed time. Newton later generalised these observations into universal laws
governing falling apples, orbiting moons, ocean tides and distant comets.

Our neighbourhood market opens every Saturday. Vendors arrange pyramids of oranges, peaches, plums, grapes
and melons beside baskets of mushrooms, onions, garlic, carrots, potatoes, cabbages and spinach. A cheerful
fishmonger shouts prices; a quiet beekeeper sells honey, candles and wax polish; a baker offers croissants,
baguettes, muffins and cinnamon buns while musicians busk near the clock tower, collecting coins in a hat.

Engineers building bridges consider wind, traffic, temperature, corrosion, earthquakes and budgets.
Suspension bridges hang their decks from cables draped between tall towers; arch bridges push their loads
outward into solid abutments; cantilever designs balance heavy arms around sturdy central piers. Every
rivet, weld and bolt gets inspected regularly, because small cracks quietly become catastrophic failures.

Libraries preserve knowledge through centuries. Librarians catalogue manuscripts, atlases, dictionaries,
encyclopaedias, newspapers, pamphlets, photographs and recordings, so that curious readers might discover
forgotten poems, ancient recipes, genealogies, legal judgements, scientific journals or handwritten
letters exchanged between lovers, soldiers, merchants, explorers, philosophers and revolutionaries.
"""


def build_tokenizer() -> PreTrainedTokenizerFast:
    # Byte-level BPE (GPT-2/Llama-3 style) never meets an unknown character, so any prompt works.
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    return as_llama_tokenizer(tok, MAX_LEN)


def as_llama_tokenizer(tok: Tokenizer, max_len: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE ``tok`` holding SPECIAL_TOKENS, dressed as a Llama tokenizer with the chat template.

    Prepends <s> like Llama: vLLM's completions endpoint adds special tokens, its chat endpoint does not
    (the template writes bos_token itself), so both paths see exactly one <s>."""
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
            ),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=max_len,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def unprintable_ids(tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """Special tokens, plus tokens whose text is not printable ASCII: lone UTF-8 bytes (0x80-0xff) that
    stream as "" or U+FFFD, control bytes, newlines. The training text is ASCII, so merges are too."""
    banned = []
    for i in range(len(tokenizer)):
        text = tokenizer.decode([i])
        if i in tokenizer.all_special_ids or not text or not all(" " <= c <= "~" for c in text):
            banned.append(i)
    return banned


def build_model(
    vocab_size: int, banned_ids: list[int], bos_id: int, eos_id: int, pad_id: int
) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,  # head_dim 64: vLLM's CPU attention rejects smaller heads (e.g. 16)
        num_key_value_heads=1,  # GQA, as in real Llama models, so the KV-cache layout is realistic
        head_dim=64,
        max_position_embeddings=MAX_LEN,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    # Fill every tensor ourselves from one seeded generator, in name order, so the bytes do not depend on
    # how a transformers release happens to initialise weights.
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif "embed_tokens" in name:
                # Unit-scale embeddings (not the usual 0.02) keep tokens distinguishable after the norms,
                # so greedy decoding wanders over the vocabulary instead of repeating one token.
                param.copy_(torch.randn(param.shape, generator=gen))
            else:
                std = 1.0 / param.shape[-1] ** 0.5  # fan-in scaling: activations stay O(1)
                param.copy_(torch.randn(param.shape, generator=gen) * std * 2.0)
        # Zero logits for banned tokens: the max over ~1.5k random logits is positive, so greedy output
        # never emits </s> (it always runs to max_tokens, as benchmarks want) and every streamed token
        # is readable ASCII text (one non-empty delta per token).
        model.lm_head.weight[banned_ids] = 0.0
    model.generation_config = GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id)
    return model


def build(outdir: Path) -> None:
    torch.manual_seed(SEED)
    tokenizer = build_tokenizer()
    model = build_model(
        len(tokenizer),
        unprintable_ids(tokenizer),
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
    # Into OUTDIR, a fresh directory: pdserve renames it into the cache once complete (engines/model.py).
    tokenizer.save_pretrained(outdir)
    model.save_pretrained(outdir)
    (outdir / "pdserve_model.json").write_text(
        json.dumps({"name": "pdserve-tiny", "seed": SEED, "dtype": "float32"}, indent=2) + "\n"
    )


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {argv[0]} OUTDIR", file=sys.stderr)
        return 2
    build(Path(argv[1]).resolve())
    print(argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
