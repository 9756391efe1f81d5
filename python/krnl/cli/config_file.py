"""train's --config: a YAML file of option values, checked against the parser's options (their
types and choices) and filled in where the command line leaves them out."""

import argparse
import sys

# Former spellings, still accepted with a note: --quantize was "hold the base quantized" on train but
# "write an MLX folder" on fuse, and `krnl quantize` said --bits; one vocabulary now, mlx-lm's.
# {former dest: the dest of the option it is now}
RENAMED = {"quantize": "q_bits", "bits": "q_bits", "group_size": "q_group_size"}


def yaml_defaults(path, parser):
    """Train options from a YAML file (mlx-lm style: flat keys with underscores or dashes, and a
    lora_parameters mapping with rank, alpha or scale, dropout). Unknown keys are errors."""
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except OSError as e:
        raise SystemExit(f"krnl train: error: --config {path}: {e.strerror}")
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        raise SystemExit(f"krnl train: error: {path}{where}: invalid YAML ({getattr(e, 'problem', e)})")
    if not isinstance(data, dict):
        raise SystemExit(f"krnl train: error: {path}: expected a mapping of options")
    known = {a.dest for a in parser._actions}
    out = {}
    lp = data.pop("lora_parameters", None) or {}
    if not isinstance(lp, dict):
        raise SystemExit(f"krnl train: error: {path}: lora_parameters must be a mapping (rank, alpha or scale, "
                         f"dropout, keys), got {lp!r}")
    if lp:
        rank = _yaml_number(path, "lora_parameters.rank", lp.get("rank", parser.get_default("lora_rank")), int)
        out["lora_rank"] = rank
        if "alpha" in lp:
            out["lora_alpha"] = _yaml_number(path, "lora_parameters.alpha", lp["alpha"], float)
        elif "scale" in lp:  # mlx-lm stores alpha / r
            out["lora_alpha"] = _yaml_number(path, "lora_parameters.scale", lp["scale"], float) * rank
        if "dropout" in lp:
            out["lora_dropout"] = _yaml_number(path, "lora_parameters.dropout", lp["dropout"], float)
        if "keys" in lp:  # mlx-lm's module keys, e.g. [self_attn.q_proj, mlp.gate_proj]
            out["lora_targets"] = _yaml_list(path, "lora_parameters.keys", lp["keys"])
    actions = {a.dest: a for a in parser._actions}
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        if dest in RENAMED:
            print(f"krnl: {path}: option {key!r} is spelled {RENAMED[dest]} now", file=sys.stderr)
            dest = RENAMED[dest]
        if dest not in known or dest in ("help", "config"):
            raise SystemExit(f"krnl train: error: {path}: unknown option {key!r}")
        out[dest] = _yaml_value(path, key, value, actions[dest])
    return out


def _yaml_number(path, key, value, kind):
    """`value` as an int or float, or SystemExit naming the file and the option."""
    what = "an integer" if kind is int else "a number"
    try:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError
        v = float(value)
        if kind is int:
            if v != int(v):
                raise ValueError
            return int(v)
        return v
    except (ValueError, OverflowError):
        raise SystemExit(f"krnl train: error: {path}: option {key!r} must be {what}, got {value!r}") from None


def _yaml_list(path, key, value):
    """A comma-separated string from a YAML list or scalar (--lora-layers, --lora-targets, --betas)."""
    if isinstance(value, (list, tuple)):
        if not all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value):
            raise SystemExit(f"krnl train: error: {path}: option {key!r} must be a list of names or numbers, "
                             f"got {value!r}")
        return ",".join(str(v) for v in value)
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        return str(value)
    raise SystemExit(f"krnl train: error: {path}: option {key!r} must be a comma-separated string or a list, "
                     f"got {value!r}")


def _yaml_value(path, key, value, action):
    """A YAML option's value checked against its flag: type, choices, true/false for switches."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction)):
        if not isinstance(value, bool):
            raise SystemExit(f"krnl train: error: {path}: option {key!r} must be true or false, got {value!r}")
        return value
    if value is None:  # YAML null: the flag's default
        return action.default
    if action.dest in ("lora_layers", "lora_targets", "betas"):
        return _yaml_list(path, key, value)
    if action.type in (int, float):
        value = _yaml_number(path, key, value, action.type)
    elif isinstance(value, (list, dict, bool)):
        raise SystemExit(f"krnl train: error: {path}: option {key!r} must be a single value, got {value!r}")
    else:
        value = str(value)
    if action.choices is not None and value not in action.choices:
        raise SystemExit(f"krnl train: error: {path}: option {key!r} must be one of "
                         f"{', '.join(map(str, action.choices))}, got {value!r}")
    return value
