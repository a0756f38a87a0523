"""The JSON Schema of every request field the server accepts, by name, for /openapi.json. A name
means the same thing wherever it appears, except where a route overrides it (openapi.py): e.g.
`prompt` is text for Ollama but text or token ids for the completion APIs.

Field *sets* are not repeated here: each route's handler owns its set (GENERATE_FIELDS, ...), and
openapi.py builds the body schemas from those, so a field added to a handler must get a schema here
(tests/server/test_openapi.py checks it)."""
from __future__ import annotations

STRING = {"type": "string"}
INTEGER = {"type": "integer"}
NUMBER = {"type": "number"}
BOOLEAN = {"type": "boolean"}
OBJECT = {"type": "object"}
TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}
STRINGS = {"type": "array", "items": STRING}
STOP = {"oneOf": [STRING, STRINGS], "description": "a stop string or a list of them"}
PRIORITY = {"oneOf": [INTEGER, {"type": "string", "enum": ["high", "normal", "low"]}],
            "description": "lower integers run first; 0 is normal"}
MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"oneOf": [STRING, {"type": "array", "items": OBJECT}, {"type": "null"}]},
        "name": STRING,
        "tool_calls": {"type": "array", "items": OBJECT},
        "tool_call_id": STRING,
        "images": STRINGS,
        "thinking": STRING,
    },
}
MESSAGES = {"type": "array", "items": MESSAGE}
PROMPTS = {"oneOf": [STRING, STRINGS, TOKEN_IDS, {"type": "array", "items": TOKEN_IDS}]}


def described(schema: dict, text: str) -> dict:
    return {**schema, "description": text}


FIELDS: dict[str, dict] = {
    # naming the model and the response
    "model": described(STRING, "model name, alias or path; the served model if omitted where allowed"),
    "name": described(STRING, "older spelling of `model`"),
    "stream": BOOLEAN,
    "stream_options": {"type": "object", "properties": {"include_usage": BOOLEAN}},
    "keep_alive": {"oneOf": [STRING, NUMBER], "description": "how long the model stays loaded after this request: a duration (\"5m\") or seconds; 0 unloads, negative keeps it loaded"},
    "format": {"oneOf": [STRING, OBJECT], "description": "`json` or a JSON schema"},
    "response_format": OBJECT,
    # Structured output (server/structured_params.py): vLLM's guided_* and structured_outputs,
    # llama-server's grammar and json_schema.
    "guided_json": {"oneOf": [OBJECT, STRING], "description": "a JSON schema (or its text)"},
    "guided_regex": described(STRING, "a regular expression the output matches"),
    "guided_choice": described(STRINGS, "the output is one of these strings"),
    "guided_grammar": described(STRING, "a Lark or GBNF grammar"),
    "structured_outputs": described(OBJECT, "one of json, regex, choice, grammar"),
    "grammar": described(STRING, "a GBNF grammar"),
    "json_schema": described(OBJECT, "a JSON schema"),
    "think": described({"oneOf": [BOOLEAN, STRING]},
                       "a thinking model's reasoning apart, in `thinking` (true, a level, or unset); false renders its "
                       "template with enable_thinking false; true for a model that does not think is a 400"),
    "priority": PRIORITY,
    "user": STRING,
    "echo": described(BOOLEAN, "the prompt before the completion; with logprobs, the prompt's own logprobs "
                                "too (the first token's null); max_tokens 0 then scores the prompt alone"),
    "encoding_format": {"type": "string", "enum": ["float", "base64"]},
    # inputs
    "prompt": STRING,
    "suffix": STRING,
    "system": STRING,
    "template": described(STRING, "this request's prompt template (Go or Jinja form), instead of the model's"),
    "raw": BOOLEAN,
    "images": STRINGS,
    "context": described(TOKEN_IDS, "the `context` of an earlier /api/generate answer, to continue from"),
    "messages": MESSAGES,
    "tools": {"type": "array", "items": OBJECT},
    "tool_choice": described({"oneOf": [{"type": "string", "enum": ["auto", "none", "required"]}, OBJECT]},
                             '"auto", "none", "required" or {"type": "function", "function": {"name": ...}}'),
    "parallel_tool_calls": described(BOOLEAN, "several calls in one answer (default true); false: at most one"),
    "input": {"oneOf": [STRING, STRINGS]},
    "content": STRING,
    "tokens": TOKEN_IDS,
    "add_special": BOOLEAN,
    "add_special_tokens": BOOLEAN,
    "with_pieces": described(BOOLEAN, "each token as {id, piece}: its text, or its bytes where not whole UTF-8"),
    "add_generation_prompt": described(BOOLEAN, "end the prompt with the assistant's turn opening (default "
                                                "true); false: it ends with the last message"),
    "continue_final_message": described(BOOLEAN, "leave the last (assistant) message open, so the answer goes "
                                                 "on writing it (vLLM's assistant prefill)"),
    "chat_template_kwargs": described(OBJECT, "variables for the chat template (e.g. enable_thinking); not "
                                              "messages, tools or add_generation_prompt"),
    "truncate": described(BOOLEAN, "cut an input longer than the context instead of rejecting it"),
    "shift": described(BOOLEAN, "when the context fills up, drop older tokens and go on"),
    "dimensions": {"type": "integer", "minimum": 1},
    "truncate_prompt_tokens": described(INTEGER, "keep the last k prompt tokens; -1: as many as fit"),
    "verbose": BOOLEAN,
    # sampling and limits
    "max_tokens": described({"type": "integer", "minimum": 0}, "at least 1; 0 only with /v1/completions' echo; "
                            "/v1/completions' default is 16 (null: to the context's end)"),
    "max_completion_tokens": {"type": "integer", "minimum": 1},
    "n_predict": described(INTEGER, "-1: until the model stops (within the server's --max-tokens); "
                                    "0: evaluate the prompt into the cache, generate nothing"),
    "min_tokens": {"type": "integer", "minimum": 0},
    "n": {"type": "integer", "minimum": 1},
    "best_of": INTEGER,
    "logit_bias": described({"type": "object", "additionalProperties": {"type": "number", "minimum": -100,
                                                                         "maximum": 100}},
                            "token id (as a string) -> a value added to its logit every step: -100 bans it"),
    "temperature": {"type": "number", "minimum": 0},
    "top_k": INTEGER,
    "top_p": {"type": "number", "minimum": 0, "maximum": 1},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "typical_p": {"type": "number", "minimum": 0, "maximum": 1},
    "repeat_penalty": {"type": "number", "exclusiveMinimum": 0},
    "repetition_penalty": {"type": "number", "exclusiveMinimum": 0},
    "repeat_last_n": INTEGER,
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "seed": INTEGER,
    "stop": STOP,
    "stop_token_ids": TOKEN_IDS,
    "ignore_eos": BOOLEAN,
    "include_stop_str_in_output": described(BOOLEAN, "vLLM's; only false: the stop string is never kept"),
    "logprobs": BOOLEAN,
    "top_logprobs": {"type": "integer", "minimum": 0},
    "n_probs": {"type": "integer", "minimum": 0},
    "speculative": described(BOOLEAN, "speculative decoding (prompt lookup) for this request, overriding the "
                                      "server's --speculative; greedy and seeded output are the same either way"),
    "num_speculative_tokens": described({"type": "integer", "minimum": 0, "maximum": 16},
                                        "most tokens proposed per step for this request; 0: none"),
    "cache_prompt": described(BOOLEAN, "accepted; the prefix cache is always on"),
    "id_slot": described(INTEGER, "accepted; there are no slots"),
    # /load
    "num_ctx": {"type": "integer", "minimum": 2},
    "kv_size": {"type": "integer", "minimum": 16},
    "parallel": {"type": "integer", "minimum": 1},
    "batch_size": {"type": "integer", "minimum": 1},
    "ubatch_size": {"type": "integer", "minimum": 1},
    "dtype": {"type": "string", "enum": ["auto", "gguf", "bf16", "fp32"]},
    # /api/pull
    "insecure": BOOLEAN,
    "username": STRING,
    "password": STRING,
    # /api/copy, /api/create
    "source": STRING,
    "destination": STRING,
    "modelfile": described(STRING, "Modelfile text: FROM, PARAMETER, SYSTEM, TEMPLATE, MESSAGE"),
    "from": described(STRING, "the installed model the new one is made from"),
    "parameters": described(OBJECT, "default options (Ollama option names)"),
    **{k: described(v, "not supported: a 400 when given") for k, v in {
        "quantize": STRING, "files": OBJECT, "adapters": OBJECT}.items()},
    **{k: described(v, "accepted; no effect") for k, v in {"license": {"oneOf": [STRING, STRINGS]},
                                                           "path": STRING}.items()},
    # accepted for compatibility, without effect
    **{k: described(v, "accepted; no effect") for k, v in {
        "store": BOOLEAN, "metadata": OBJECT, "service_tier": STRING, "safety_identifier": STRING,
        "prompt_cache_key": STRING, "verbosity": STRING,
        "prompt_cache_retention": STRING, "prompt_cache_options": OBJECT,
    }.items()},
    "prediction": described(OBJECT, 'predicted output ({"type": "content", "content": text or text parts}): '
                                     "looked up by speculative decoding; the answer is unchanged, the usage's "
                                     "completion_tokens_details says how much of it was used"),
    "modalities": described(STRINGS, 'only "text": "audio" is a 400'),
    "reasoning_effort": described({"enum": ["none", "minimal", "low", "medium", "high", "xhigh"]},
                                  '"none": a thinking model\'s template with enable_thinking false; '
                                  'the others its default'),
    **{k: described(v, "not supported: a 400 when given") for k, v in {
        "audio": OBJECT, "functions": {"type": "array", "items": OBJECT},
        "function_call": {"oneOf": [STRING, OBJECT]},
        "web_search_options": OBJECT}.items()},
}

# Ollama's `options` object.
OPTIONS: dict[str, dict] = {
    "num_keep": described(INTEGER, "leading tokens a truncation or context shift keeps; -1: the whole prompt"),
    "num_ctx": {"type": "integer", "minimum": 2},
    "num_predict": described({"type": "integer", "minimum": -2},
                             "-1: until the model stops, -2: until the context is full; both within --max-tokens"),
    **{k: FIELDS[k] for k in ("seed", "stop", "temperature", "top_k", "top_p", "min_p", "typical_p",
                              "repeat_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty",
                              "speculative", "num_speculative_tokens")},
    **{k: described(v, "accepted; no effect") for k, v in {
        "num_batch": INTEGER, "num_gpu": INTEGER, "main_gpu": INTEGER, "use_mmap": BOOLEAN, "use_mlock": BOOLEAN,
        "num_thread": INTEGER, "numa": BOOLEAN, "low_vram": BOOLEAN, "f16_kv": BOOLEAN, "vocab_only": BOOLEAN,
        "logits_all": BOOLEAN, "embedding_only": BOOLEAN, "penalize_newline": BOOLEAN, "mirostat": INTEGER,
        "mirostat_tau": NUMBER, "mirostat_eta": NUMBER, "tfs_z": NUMBER, "num_gqa": INTEGER,
        "rope_frequency_base": NUMBER, "rope_frequency_scale": NUMBER,
    }.items()},
}
