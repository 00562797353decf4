"""Result lines in the OpenAI Batch API's output format (`output.format: openai`):

    {"custom_id": ..., "id": "batch_req_...", "response": {"status_code": 200, "request_id": ...,
     "body": <a ChatCompletion, a Completion or an embeddings list>}, "error": null}

and, for a request that cannot be served (the record's fault), status_code 400 with an error
body, as OpenAI writes them. `custom_id` comes first: the results file is resumed by it
(launcher.writer). Ids are derived from the custom_id, so a re-run writes the same ones.
"""

from __future__ import annotations

import hashlib
import itertools
import time

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
EMBEDDINGS_URL = "/v1/embeddings"


def _id(prefix: str, custom_id: str) -> str:
    return f"{prefix}{hashlib.sha256(custom_id.encode()).hexdigest()[:24]}"


SERVER_ERRORS = ("quarantined", "InternalError")     # launcher.records error_result types that are not the request's


def _line(custom_id: str, status: int, body: dict) -> dict:
    """A failed request's line has its error in the response body, as OpenAI's, and its message at
    the top as well, as vLLM's run_batch puts it: a reader of either finds it. (A string there: the
    writer tells an error line by the object, launcher.writer.FAILED, once a line.)"""
    error = body.get("error")
    return {"custom_id": custom_id, "id": _id("batch_req_", custom_id),
            "response": {"status_code": status, "request_id": _id("req_", custom_id), "body": body},
            "error": error and error["message"]}


def openai_line(result: dict, url: str, top_logprobs: int | None, model: str, token_text,
                cached_tokens: int = 0, reasoning: bool = True, echo: str | None = None, forced: bool = False,
                token_ids: bool = False, role: str = "assistant") -> dict:
    """The output line of one msinfer result (launcher.records: one output, or `outputs` for n
    samples; or an error) for a request to `url`; `top_logprobs`: the alternatives asked for
    (None: no log-probabilities); `token_text(id)`: a token's text; `cached_tokens`: prompt
    tokens found in the prefix cache; `reasoning`: the request's include_reasoning; `echo`: a
    completion's echo, "all" (the prompt's text, and with log-probabilities its tokens', before
    each choice's: the result's prompt_text, prompt_token_ids and prompt_logprobs) or "prompt"
    (the prompt's alone, as vLLM answers max_tokens 0); a chat completion's, "chat" (the
    result's prompt_text before each message's content); `forced`: its tool_choice is "required" or
    a named function; `token_ids`: its return_token_ids (vLLM's: each choice's `token_ids`, and the
    prompt's `prompt_token_ids`, beside the choices of a chat completion, on each choice of a
    completion); `role`: a chat answer's (vLLM's: the last message's where the request opens no
    new assistant message, add_generation_prompt false)."""
    custom_id = result["id"]
    if result.get("error"):             # the request's fault (400), or the server's (500: a record
        # quarantined for the replica failures it ran in, an inconsistency of msinfer's own)
        server = result["error"]["type"] in SERVER_ERRORS
        return _line(custom_id, 500 if server else 400, {"error": {
            "message": result["error"]["message"], "type": "server_error" if server else "invalid_request_error",
            "param": None, "code": None}})
    if url == EMBEDDINGS_URL:         # (task embed, launcher.embed): one vector per input, in order
        vectors = result["embeddings"] if "embeddings" in result else [result["embedding"]]
        return _line(custom_id, 200, {
            "id": _id("embd-", custom_id), "object": "list", "created": int(time.time()), "model": model,
            "data": [{"index": i, "object": "embedding", "embedding": v} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": result["prompt_tokens"], "total_tokens": result["prompt_tokens"]}})
    chat = url == CHAT_URL
    usage = {"prompt_tokens": result["prompt_tokens"], "completion_tokens": result["completion_tokens"],
             "total_tokens": result["prompt_tokens"] + result["completion_tokens"],
             "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    outputs = result.get("outputs") or [result]
    # each choice's prompt fields: its output's where a request's several prompts give each its
    # own (launcher.records), else the result's
    prompts = [out if "prompt_token_ids" in out else result for out in outputs]

    def echoed(given: dict) -> tuple:
        """What echo puts before a choice, from its prompt's fields."""
        return (given["prompt_text"],) if chat else \
            (given["prompt_text"], given["prompt_token_ids"], given.get("prompt_logprobs") or [])
    choices = [_choice(i, out, chat, top_logprobs, token_text, reasoning, echo, echoed(given) if echo else None,
                       forced, role) for i, (out, given) in enumerate(zip(outputs, prompts))]
    if chat:
        body = {"id": _id("chatcmpl-", custom_id), "object": "chat.completion"}
    else:
        body = {"id": _id("cmpl-", custom_id), "object": "text_completion"}
        for choice, given in zip(choices, prompts):    # vLLM's: a completion's choice holds its prompt's
            if "prompt_logprobs" in given:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(given, token_text)
    body.update(created=int(time.time()), model=model, choices=choices, usage=usage)
    if chat and "prompt_logprobs" in result:        # vLLM's: a chat completion's, beside its choices
        body["prompt_logprobs"] = vllm_prompt_logprobs(result, token_text)
    if token_ids:
        for choice, out, given in zip(choices, outputs, prompts):
            choice["token_ids"] = None if chat and _hides_metadata(out, reasoning) else list(out["output_token_ids"])
            if not chat:
                choice["prompt_token_ids"] = given.get("prompt_token_ids")
        if chat:
            body["prompt_token_ids"] = result.get("prompt_token_ids")
    return _line(custom_id, 200, body)


def vllm_prompt_logprobs(result: dict, token_text) -> list:
    """A result's prompt_logprobs as vLLM's OpenAI server answers them: per prompt token None
    (the first) or {token id: {"logprob", "rank", "decoded_token"}}, the token's own first (its
    rank: the tokens at least as likely, `prompt_ranks`), then the k most likely
    (`prompt_logprobs: k`), ranked by their place."""
    out = []
    for token, entry, rank in zip(result["prompt_token_ids"], result["prompt_logprobs"], result["prompt_ranks"]):
        if entry is None:
            out.append(None)
            continue
        top = entry["top"] if isinstance(entry, dict) else []
        own = entry["logprob"] if isinstance(entry, dict) else entry
        got = {str(token): {"logprob": own, "rank": rank, "decoded_token": token_text(token)}}
        for place, (alt, value, *_) in enumerate(top, 1):
            got.setdefault(str(alt), {"logprob": value, "rank": place, "decoded_token": token_text(alt)})
        out.append(got)
    return out


def _choice(index: int, out: dict, chat: bool, top_logprobs: int | None, token_text, reasoning: bool = True,
            echo: str | None = None, prompt: tuple | None = None, forced: bool = False,
            role: str = "assistant") -> dict:
    """One choice of the body; `forced`: the request's tool_choice is "required" or a named
    function (vLLM's message then has content "", not null, beside its calls)."""
    text = out.get("output_text") or ""
    logprobs = None
    entries = out.get("logprobs") if top_logprobs is not None else None
    ids = out.get("output_token_ids") or []
    if prompt is not None and not chat:     # echo: the prompt's text and tokens first, or alone
        p_text, p_ids, p_entries = prompt
        text = p_text if echo == "prompt" else p_text + text
        # the prompt's entries: None for its first token, a float with prompt_logprobs 0
        head = [e if e is None or isinstance(e, dict) else {"logprob": e, "top": []} for e in p_entries]
        head += [None] * (len(p_ids) - len(head))
        if top_logprobs is not None:
            ids, entries = (p_ids, head) if echo == "prompt" else (p_ids + ids, head + (entries or []))
    if entries and chat:                # vLLM's candidates: the sampled token first, then the most likely
        logprobs = {"content": [_chat_logprob(token_text(t), e["logprob"],
                                              [(token_text(a), v) for a, v in
                                               _sampled_first(t, e["logprob"], e["top"])[:top_logprobs]])
                                for t, e in zip(ids, entries)], "refusal": None}
    elif entries:
        texts = [token_text(t) for t in ids[:len(entries)]]
        offsets = [0, *itertools.accumulate(map(len, texts))][:len(texts)]     # (an echoed prompt: long)
        # vLLM's: each token's own first, then the top_logprobs most likely (the same token once)
        logprobs = {"tokens": texts, "token_logprobs": [e and e["logprob"] for e in entries],
                    "top_logprobs": [e and {tok: e["logprob"], **{token_text(a): v for a, v, *_ in e["top"][:top_logprobs]
                                                                 if token_text(a) != tok}}
                                     for tok, e in zip(texts, entries)],
                    "text_offset": offsets}
    if chat:
        if _hides_metadata(out, reasoning):
            logprobs = None
        message = {"role": role, "content": text, "refusal": None}
        if "reasoning" in out:          # output.reasoning_parser: vLLM's message, content null without an answer
            message.update(content=text or None, reasoning=out["reasoning"] if reasoning else None)
        if out.get("tool_calls"):       # (launcher.tools) content null where it has only calls; "" where
            message.update(content=text or ("" if forced else None), tool_calls=out["tool_calls"])  # forced
        if prompt is not None:          # echo: the last message's text first (vLLM's, content "" at least)
            message["content"] = prompt[0] + (message["content"] or "")
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": out["finish_reason"],
                "stop_reason": out.get("stop_reason")}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": out["finish_reason"],
            "stop_reason": out.get("stop_reason")}


def _hides_metadata(out: dict, reasoning: bool) -> bool:
    """Whether a chat choice's logprobs and token ids are left out: vLLM's suppressed metadata,
    where the request's include_reasoning is false and a reasoning parser split the text."""
    return "reasoning" in out and not reasoning


def _sampled_first(token: int, logprob: float, top: list) -> list[tuple[int, float]]:
    """A chat token's top_logprobs candidates as vLLM orders them (its engine puts the sampled
    token first, and chat takes the first top_logprobs): the token itself, then the most likely
    others. The same as the most likely where the token is the most likely (greedy)."""
    return [(token, logprob), *((a, v) for a, v, *_ in top if a != token)]


def _chat_logprob(token: str, logprob: float, top: list) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8")),
            "top_logprobs": [{"token": a, "logprob": v, "bytes": list(a.encode("utf-8"))} for a, v in top]}
