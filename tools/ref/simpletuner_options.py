#!/usr/bin/env python3
"""SimpleTuner's option table, read from its own argument parser, for src/train/simpletuner_options.inc.

dtune accepts every SimpleTuner option: the ones it implements with their meaning, the others at
SimpleTuner's default only. This script asks SimpleTuner itself which options exist, under which
spellings, with which type and default, so the table can be refreshed when SimpleTuner changes.

Usage (SimpleTuner is read, never committed or vendored):
    git clone https://github.com/bghira/SimpleTuner /tmp/st-src && git -C /tmp/st-src checkout bc8e6ab
    python3 tools/ref/simpletuner_options.py /tmp/st-src > src/train/simpletuner_options.inc
    python3 tools/ref/simpletuner_options.py /tmp/st-src --defaults-json > tests/data/ref/simpletuner_defaults.json
The second form writes SimpleTuner's defaults as a config.json (every option, "--" keys), which a
test loads through dtune.

Only the parser is needed, not a working SimpleTuner install: the packages its model modules import
(fastapi, torchaudio, model-specific libraries) are replaced by inert placeholders while the parser
is built, and model classes that still fail to import are skipped (they only narrow a few option
choices, never a default). The defaults are the values argparse yields for an empty command line, so
string defaults of numeric options come out converted, as SimpleTuner sees them.
"""
import argparse
import importlib.abc
import importlib.machinery
import json
import subprocess
import sys
import types


class _Inert:
    """Stands in for any object of a package that is not installed."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Inert()

    def __getattr__(self, name):
        return _Inert()

    def __getitem__(self, key):
        return _Inert()

    def __iter__(self):
        return iter(())

    def __mro_entries__(self, bases):
        return (object,)

    def __bool__(self):
        return False

    def __or__(self, other):
        return self

    __ror__ = __or__


class _InertModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert()


class _MissingPackages(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves an inert module for an import that SimpleTuner's own files make and nothing can satisfy."""

    def __init__(self, root):
        self.root = root

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "simpletuner":
            return None
        frame = sys._getframe(1)
        while frame is not None and ("importlib" in frame.f_code.co_filename or frame.f_code.co_filename == __file__):
            frame = frame.f_back
        if frame is None or not frame.f_code.co_filename.startswith(self.root):
            return None  # an import made by an installed package fails as it normally would
        for finder in sys.meta_path:
            if finder is self:
                continue
            try:
                if finder.find_spec(name, path, target) is not None:
                    return None
            except Exception:
                continue
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        module = _InertModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def load_parser(root):
    sys.path.insert(0, root)
    sys.meta_path.append(_MissingPackages(root))
    # The web server's package __init__ files start the whole app; the registry only needs the modules.
    for name in ("simpletuner", "simpletuner.simpletuner_sdk", "simpletuner.simpletuner_sdk.server",
                 "simpletuner.simpletuner_sdk.server.services"):
        package = types.ModuleType(name)
        package.__path__ = [root + "/" + name.replace(".", "/")]
        sys.modules[name] = package
    import simpletuner.helpers.models.registry as model_registry

    lazy_getattr = model_registry.LazyModelClass.__getattr__

    def tolerant_getattr(self, name):
        try:
            return lazy_getattr(self, name)
        except Exception:
            raise AttributeError(name)

    model_registry.LazyModelClass.__getattr__ = tolerant_getattr
    from simpletuner.helpers.configuration import cmd_args

    return cmd_args.get_argument_parser()


def type_code(action):
    name = getattr(action.type, "__name__", "")
    if "bool" in name or "flag" in name:
        return "b"
    return {"int": "i", "float": "f"}.get(name, "s")


def main():
    root = sys.argv[1].rstrip("/")
    want_json = "--defaults-json" in sys.argv[2:]
    rest = [a for a in sys.argv[2:] if a != "--defaults-json"]
    label = rest[0] if rest else ""
    parser = load_parser(root)
    actions = [a for a in parser._actions if a.dest != "help"]
    for a in actions:
        a.required = False
    defaults = vars(parser.parse_args([]))
    if want_json:
        config = {}
        for a in sorted(actions, key=lambda a: a.dest):
            try:
                json.dumps(defaults.get(a.dest))
                config["--" + a.dest] = defaults.get(a.dest)
            except TypeError:
                config["--" + a.dest] = str(defaults.get(a.dest))
        print(json.dumps(config, indent=1, sort_keys=True))
        return
    try:
        commit = label or subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
    except OSError:
        commit = ""
    print("// Generated by tools/ref/simpletuner_options.py from SimpleTuner's argument parser"
          + (f" (commit {commit})" if commit else "") + "; do not edit.")
    print("// Row: name, type (s string, i integer, f number, b boolean), default as JSON, other spellings.")
    for a in sorted(actions, key=lambda a: a.dest):
        default = defaults.get(a.dest)
        try:
            default_json = json.dumps(default)
        except TypeError:
            default_json = json.dumps(str(default))
        spellings = [s.lstrip("-") for s in a.option_strings if s.lstrip("-") != a.dest]
        print('{"%s", \'%s\', R"(%s)", "%s"},' % (a.dest, type_code(a), default_json, ",".join(spellings)))


if __name__ == "__main__":
    main()
