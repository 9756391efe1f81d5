"""Tokenizers of Hugging Face checkpoints: tokenizer.json through the `tokenizers` library, the
special tokens and BOS/EOS behaviour from tokenizer_config.json (and special_tokens_map.json),
and chat formatting from the checkpoint's chat template rendered with jinja2 the way
transformers renders it (sandboxed environment, trim_blocks and lstrip_blocks, loop controls,
`raise_exception`, `tojson`, `strftime_now`, the special tokens as variables, a no-op
`{% generation %}` tag). A checkpoint without a template gets a plain "role: content" one.
"""

import json
from datetime import datetime
from pathlib import Path

from .fileio import read_json_object

# The plain template of checkpoints that define none: "role: content" lines, each assistant
# turn closed by the end token. Rendering a conversation up to any turn gives a prefix of the
# whole rendering, which the prompt masking of krnl.train.data relies on. The generation prompt is
# "assistant:" without the space, so that the space starts the answer's first token (" The")
# rather than ending the prompt with a token the model never sees in training.
FALLBACK_CHAT_TEMPLATE = (
    "{{ bos_token if add_bos else '' }}"
    "{% if tools %}{{ 'tools: ' + (tools | tojson) + '\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ message['role'] + ':' }}"
    "{% if message['content'] %}{{ ' ' + message['content'] }}{% endif %}"
    "{% for tc in message['tool_calls'] or [] %}"
    "{{ ' ' + ((tc['function'] if tc['function'] is defined else tc) | tojson) }}"
    "{% endfor %}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _token_str(v):
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def compile_chat_template(source):
    """A jinja2 template compiled as transformers compiles chat templates."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        # {% generation %}...{% endgeneration %} marks assistant text for transformers'
        # return_assistant_tokens_mask; here it renders its body unchanged.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


class Tokenizer:
    """A checkpoint's tokenizer. encode() adds BOS/EOS as the checkpoint defines (tokenizer_config's
    add_bos_token / add_eos_token when given, otherwise what tokenizer.json's post-processor adds);
    chat text is rendered by apply_chat_template and encoded without added tokens, as
    transformers does (the template writes its own BOS)."""

    def __init__(self, tk, config=None, special_tokens_map=None, chat_template=None, source="<tokenizer>"):
        self.tk = tk
        self.source = str(source)
        config = dict(config or {})
        self.config = config
        tokens = {}
        for k, v in (special_tokens_map or {}).items():
            if k in SPECIAL_TOKEN_KEYS and _token_str(v) is not None:
                tokens[k] = _token_str(v)
        for k in SPECIAL_TOKEN_KEYS:  # tokenizer_config.json wins over special_tokens_map.json
            if _token_str(config.get(k)) is not None:
                tokens[k] = _token_str(config[k])
        self.special_tokens = tokens
        self.bos_token, self.eos_token = tokens.get("bos_token"), tokens.get("eos_token")
        self.pad_token = tokens.get("pad_token")
        self.bos_id = self._id(self.bos_token, "bos_token")
        self.eos_id = self._id(self.eos_token, "eos_token")
        pid = self._id(self.pad_token, "pad_token")
        self.pad_id = pid if pid is not None else (self.eos_id if self.eos_id is not None else 0)
        # What the post-processor adds to a plain encode.
        try:
            plain = tk.encode("a", add_special_tokens=False).ids
            full = tk.encode("a", add_special_tokens=True).ids
        except Exception:  # e.g. a word-level vocabulary without "a" nor an unknown token
            plain = full = []
        pp_bos = self.bos_id is not None and len(full) > len(plain) and full[0] == self.bos_id
        pp_eos = self.eos_id is not None and len(full) > len(plain) and full[-1] == self.eos_id
        self.add_bos = bool(config["add_bos_token"]) if config.get("add_bos_token") is not None else pp_bos
        self.add_eos = bool(config["add_eos_token"]) if config.get("add_eos_token") is not None else pp_eos
        if self.add_bos and self.bos_id is None:
            self.add_bos = False
        if self.add_eos and self.eos_id is None:
            self.add_eos = False
        self.chat_template = chat_template  # str, {name: str}, or None
        self._compiled = {}

    def _id(self, token, what):
        if token is None:
            return None
        i = self.tk.token_to_id(token)
        if i is None:
            raise ValueError(f"[tokenizer] {self.source}: {what} {token!r} is not in the vocabulary")
        return int(i)

    @classmethod
    def from_folder(cls, path):
        folder = Path(path)
        tj = folder / "tokenizer.json"
        if not tj.is_file():
            raise ValueError(f"[tokenizer] {folder}: no tokenizer.json (krnl reads fast tokenizers only; "
                             "convert a sentencepiece tokenizer with transformers' save_pretrained first)")
        from tokenizers import Tokenizer as _Tk

        try:
            tk = _Tk.from_file(str(tj))
        except Exception as e:  # the library raises its own exception type
            raise ValueError(f"[tokenizer] {tj}: cannot load: {e}") from e
        config = {}
        if (folder / "tokenizer_config.json").is_file():
            config = read_json_object(folder / "tokenizer_config.json", "tokenizer")
            if not isinstance(config, dict):
                raise ValueError(f"[tokenizer] {folder / 'tokenizer_config.json'}: expected a JSON object")
        stm = {}
        if (folder / "special_tokens_map.json").is_file():
            stm = read_json_object(folder / "special_tokens_map.json", "tokenizer")
            if not isinstance(stm, dict):
                raise ValueError(f"[tokenizer] {folder / 'special_tokens_map.json'}: expected a JSON object")
        template = config.get("chat_template")
        # Newer checkpoints keep the template beside the config.
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        elif template is None and (folder / "chat_template.json").is_file():
            template = read_json_object(folder / "chat_template.json", "tokenizer").get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
            template = {t["name"]: t["template"] for t in template if isinstance(t, dict) and "name" in t}
        if template is not None and not isinstance(template, (str, dict)):
            raise ValueError(f"[tokenizer] {folder}: chat_template must be a string or a list of named templates")
        return cls(tk, config, stm, template, source=folder)

    # -- plain text ----------------------------------------------------------------------------

    @property
    def vocab_size(self):
        """Number of ids the tokenizer can produce (added tokens included)."""
        return int(self.tk.get_vocab_size(with_added_tokens=True))

    def max_id(self):
        return max(self.tk.get_vocab(with_added_tokens=True).values())

    def check_vocab(self, model_vocab_size):
        """Raises when the tokenizer can produce ids the model has no embedding for."""
        m = self.max_id()
        if m >= model_vocab_size:
            raise ValueError(f"[tokenizer] {self.source}: the tokenizer has ids up to {m} but the model's vocab_size is "
                             f"{model_vocab_size}: tokenizer and model do not match")

    def encode(self, text, add_special_tokens=True):
        ids = list(self.tk.encode(text, add_special_tokens=False).ids)
        if add_special_tokens:
            if self.add_bos:
                ids = [self.bos_id] + ids
            if self.add_eos:
                ids = ids + [self.eos_id]
        return ids

    def encode_with_offsets(self, text):
        """(ids, [(start, end) character offsets]) without added tokens."""
        e = self.tk.encode(text, add_special_tokens=False)
        return list(e.ids), list(e.offsets)

    def decode(self, ids, skip_special_tokens=True):
        return self.tk.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # -- chat ------------------------------------------------------------------------------------

    @property
    def has_chat_template(self):
        return self.chat_template is not None

    def _template_source(self, tools):
        t = self.chat_template
        if t is None:
            return FALLBACK_CHAT_TEMPLATE
        if isinstance(t, str):
            return t
        if tools and "tool_use" in t:
            return t["tool_use"]
        if "default" in t:
            return t["default"]
        raise ValueError(f"[tokenizer] {self.source}: the named chat templates {sorted(t)} have no 'default'")

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=False, **kwargs):
        """The conversation rendered as text by the checkpoint's chat template."""
        src = self._template_source(tools)
        tpl = self._compiled.get(src)
        if tpl is None:
            tpl = self._compiled[src] = compile_chat_template(src)
        variables = dict(self.special_tokens)
        variables.update(kwargs)
        if src is FALLBACK_CHAT_TEMPLATE:
            variables["add_bos"] = self.add_bos
            variables.setdefault("bos_token", "")
            variables.setdefault("eos_token", "")
        return tpl.render(messages=messages, tools=tools, documents=None,
                          add_generation_prompt=add_generation_prompt, **variables)
