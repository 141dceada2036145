"""The `tiny-tools` preset's parts: a tool-aware chat template, tool-call tokens, and weights whose
every answer is one fixed tool call (`TOOL_CALL_TEXT`).

The preset is `tiny`'s shape and seed with three changes:

1. The tokenizer: the shipped one plus three added (non-special) tokens, `<tool_call>`,
   `TOOL_CALL_BODY` (the call's JSON between two newlines) and `</tool_call>`, as Qwen2.5 adds its
   tool-call tags; `tokenizer_config.json` carries `CHAT_TEMPLATE`, shaped as Qwen2.5's (tools in
   the system turn, assistant calls as `<tool_call>\\n{json}\\n</tool_call>`, tool results as
   `<tool_response>` in a user turn). mlx-lm 0.32 infers its `json_tools` parser from that
   template (`<tool_call>` and `tool_call.name` in it: `mlx_lm.tokenizer_utils._infer_tool_parser`).
2. The residual branches are cut: every `o_proj` and `down_proj` is zero, so the last hidden state
   is the (RMS-normed) embedding of the current token. q/k/v keep tiny's random draws: the KV
   cache is computed, stored and restored as for any model, but it does not change the output.
3. The lm_head is a successor map over the chain `CALL_CHAIN`: the generation prompt's last token
   ("\\n" after `assistant`) -> `<tool_call>` -> `TOOL_CALL_BODY` -> `</tool_call>` -> `<|im_end|>`
   (an EOS). The row of each successor is `SUCCESSOR_LOGIT / sqrt(hidden) * e / |e|`, `e` the
   embedding of its predecessor, every other row zero: the successor's logit is `SUCCESSOR_LOGIT`
   (64), any other token's `64 * cos` of two distinct random embeddings (below 7 here), or 0.

So every chat request, whatever it says, is answered `TOOL_CALL_TEXT` and then EOS, greedily and,
with a margin of more than 50 logits (tested), under sampling at temperature 1 too (any other
token has a probability below 4099 * e^-50 per step). This is a test fixture for
the output side of tool calling (mlx-lm's parser, kvtool serve's three APIs), not a model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_NAME = "get_weather"
TOOL_ARGUMENTS = {"city": "Paris"}
TOOL_CALL_BODY = "\n" + json.dumps({"name": TOOL_NAME, "arguments": TOOL_ARGUMENTS}) + "\n"
TOOL_CALL_TEXT = TOOL_CALL_START + TOOL_CALL_BODY + TOOL_CALL_END
ADDED_TOKENS = (TOOL_CALL_START, TOOL_CALL_BODY, TOOL_CALL_END)
GENERATION_PROMPT = "<|im_start|>assistant\n"
END_OF_TURN = "<|im_end|>"
SUCCESSOR_LOGIT = 64.0
CUT_BRANCHES = ("self_attn.o_proj.weight", "mlp.down_proj.weight")

# Qwen2.5-Instruct's template, without its default system prompt (a prompt without a system
# message is rendered as the tiny preset renders it).
CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def write_tokenizer(assets: Path, out: Path) -> None:
    """Write `tokenizer.json` and `tokenizer_config.json` of the tool preset into `out`: the files
    in `assets` plus `ADDED_TOKENS` (ids after the last one there, non-special, not normalized)
    and `CHAT_TEMPLATE`.

    Raises:
        OSError: If a file cannot be read or written.
        ValueError: If an added token is already in the shipped vocabulary.
    """
    tokenizer = json.loads((assets / "tokenizer.json").read_text(encoding="utf-8"))
    config = json.loads((assets / "tokenizer_config.json").read_text(encoding="utf-8"))
    taken = set(tokenizer["model"]["vocab"]) | {t["content"] for t in tokenizer["added_tokens"]}
    if taken & set(ADDED_TOKENS):
        raise ValueError(f"tool-call tokens already in the vocabulary: {sorted(taken & set(ADDED_TOKENS))}")
    next_id = 1 + max([*tokenizer["model"]["vocab"].values(), *(t["id"] for t in tokenizer["added_tokens"])])
    flags = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": False}
    for i, content in enumerate(ADDED_TOKENS, start=next_id):
        tokenizer["added_tokens"].append({"id": i, "content": content, **flags})
        config["added_tokens_decoder"][str(i)] = {"content": content, **flags}
    config["chat_template"] = CHAT_TEMPLATE
    for name, doc in (("tokenizer.json", tokenizer), ("tokenizer_config.json", config)):
        (out / name).write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def call_chain(tokenizer_file: Path) -> list[int]:
    """Token ids of `CALL_CHAIN` in the tokenizer at `tokenizer_file`: the last token of
    `GENERATION_PROMPT`, then `<tool_call>`, `TOOL_CALL_BODY`, `</tool_call>`, `<|im_end|>`.

    Raises:
        ValueError: If the ids are not distinct, or a chain token is not one token.
    """
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    chain = [tok.encode(GENERATION_PROMPT, add_special_tokens=False).ids[-1]]
    for text in (*ADDED_TOKENS, END_OF_TURN):
        ids = tok.encode(text, add_special_tokens=False).ids
        if len(ids) != 1:
            raise ValueError(f"{text!r} is {len(ids)} tokens, not one")
        chain.append(ids[0])
    if len(set(chain)) != len(chain):
        raise ValueError(f"the call chain repeats a token: {chain}")
    return chain


def successor_weights(weights: dict, chain: list[int]) -> dict:
    """`weights` (float32 mx arrays keyed as mlx-lm's qwen2 `Model`) with the residual branches
    cut (`CUT_BRANCHES` zero) and the lm_head a successor map over `chain` (module docstring).

    Args:
        weights: name -> mx.array, `lm_head.weight` [vocab, hidden] and `model.embed_tokens.weight`
            [vocab, hidden] among them; not modified.
        chain: Distinct token ids; `chain[i + 1]` becomes the greedy successor of `chain[i]`.

    Returns:
        A new dict name -> mx.array float32.
    """
    import mlx.core as mx

    out = dict(weights)
    with mx.stream(mx.cpu):
        for name, w in weights.items():
            if name.endswith(CUT_BRANCHES):
                out[name] = mx.zeros(w.shape, dtype=w.dtype)
        embed = weights["model.embed_tokens.weight"]
        head = mx.zeros(weights["lm_head.weight"].shape, dtype=mx.float32)
        scale = SUCCESSOR_LOGIT / math.sqrt(embed.shape[1])
        for prev, nxt in zip(chain, chain[1:]):
            e = embed[prev]
            norm = math.sqrt(math.fsum(x * x for x in e.tolist()))  # exactly rounded: the same bytes anywhere
            head[nxt] = e * mx.array(scale / norm, dtype=mx.float32)
        out["lm_head.weight"] = head
        mx.eval(out)
    return out
