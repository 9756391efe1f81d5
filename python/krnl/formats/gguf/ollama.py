"""The Ollama `Modelfile` written beside an exported GGUF (`krnl fuse --export-gguf F --ollama`), for
`ollama create NAME -f Modelfile` in that folder:

- FROM the GGUF file, by its path relative to the Modelfile;
- TEMPLATE, a Go template equivalent of the chat template for the four turn layouts krnl knows
  (ChatML, Llama 3, Gemma, Phi-3, recognised by their markers); for any other the line is left
  out with a comment: Ollama then derives the template from the GGUF's tokenizer.chat_template;
- PARAMETER stop for each end-of-turn token the chat template writes (and the EOS token), so that
  generation stops where the template closes a turn.
"""

from ...io.fileio import atomic_write_bytes

# Tokens llama.cpp and Ollama treat as a turn's end (llama-vocab.cpp's end-of-turn names, gpt-oss's)
END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
              "<|end_of_text|>", "<|return|>", "<|call|>", "</s>", "<EOT>")
# (markers that identify the layout, Go template)
GO_TEMPLATES = {
    "ChatML": (("<|im_start|>", "<|im_end|>"),
               "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}"
               "<|im_start|>assistant\n"),
    "Llama 3": (("<|start_header_id|>", "<|eot_id|>"),
                "{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n{{ .Content }}<|eot_id|>"
                "{{ end }}<|start_header_id|>assistant<|end_header_id|>\n\n"),
    "Gemma": (("<start_of_turn>", "<end_of_turn>"),
              "{{- range .Messages }}<start_of_turn>{{ if eq .Role \"assistant\" }}model{{ else }}user{{ end }}\n"
              "{{ .Content }}<end_of_turn>\n{{ end }}<start_of_turn>model\n"),
    "Phi-3": (("<|user|>", "<|end|>", "<|assistant|>"),
              "{{- range .Messages }}<|{{ .Role }}|>\n{{ .Content }}<|end|>\n{{ end }}<|assistant|>\n"),
}


def chat_layout(template):
    """The name of the GO_TEMPLATES layout a chat template writes, or None."""
    return next((k for k, (marks, _) in GO_TEMPLATES.items() if template and all(m in template for m in marks)), None)


def modelfile_text(gguf_name, tok):
    """The Modelfile's text for the GGUF file named `gguf_name` with krnl Tokenizer `tok`."""
    template = tok.chat_template.get("default") if isinstance(tok.chat_template, dict) else tok.chat_template
    lines = ["# krnl fuse --export-gguf --ollama: `ollama create NAME -f Modelfile` in this folder", "",
             f"FROM ./{gguf_name}"]
    layout = chat_layout(template)
    if layout:
        lines += [f"# the chat template's {layout} turns", f'TEMPLATE """{GO_TEMPLATES[layout][1]}"""']
    elif template:
        lines.append("# no TEMPLATE: Ollama reads the chat template from the GGUF file (tokenizer.chat_template)")
    else:
        lines.append("# no TEMPLATE: the model has no chat template (plain completion)")
    stops = [t for t in END_TOKENS if template and t in template]
    if tok.eos_token and tok.eos_token not in stops:
        stops.append(tok.eos_token)
    lines += [f'PARAMETER stop "{t}"' for t in stops]
    return "\n".join(lines) + "\n"


def write_modelfile(gguf_path, tok):
    """Writes `Modelfile` beside the GGUF file; returns its path."""
    path = gguf_path.parent / "Modelfile"
    atomic_write_bytes(path, modelfile_text(gguf_path.name, tok).encode("utf-8"))
    return str(path)
