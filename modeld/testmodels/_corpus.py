"""A deterministic, synthetic, code-flavoured text corpus for training the test tokenizer.

What: :func:`build_corpus` returns a list of documents (Python and JavaScript code, unified
diffs, pytest output, JSON, shell sessions, Makefiles with tabs, Markdown prose, and
accented / CJK / emoji samples) generated from a seed.

Why: the tokenizer of a test model must look like a coding model's tokenizer (indentation,
identifiers and punctuation become few tokens) and must be *byte-identical on every machine
and every Python version*. Training on files found on the machine (for example the standard
library's sources) would make the vocabulary depend on the Python version, so the text is
generated here instead, from fixed word lists and a tiny PRNG whose output is pinned by its
algorithm (SplitMix64), not by the ``random`` module (whose ``choice``/``randint`` may change
between Python versions).

What not: this is not realistic language data and no model is trained on it; only the BPE
merges are learned from it. Changing anything here changes every generated model: bump
``GENERATOR_VERSION`` in ``modeld.testmodels``.
"""

# The corpus is deliberately multilingual: full-width punctuation, Greek letters and curly
# quotes are content here, not typos.
# ruff: noqa: RUF001

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

__all__ = ["SplitMix64", "build_corpus"]

_T = TypeVar("_T")
_MASK64 = (1 << 64) - 1


class SplitMix64:
    """SplitMix64 (Steele, Lea, Flood 2014): a 64-bit PRNG fully defined by its algorithm.

    Its output never depends on the Python or NumPy version. ``below(n)`` uses a plain modulo;
    the bias (at most n / 2**64) is irrelevant here and keeps the mapping trivially stable.
    """

    def __init__(self, seed: int) -> None:
        self._state = seed & _MASK64

    def next_u64(self) -> int:
        self._state = (self._state + 0x9E3779B97F4A7C15) & _MASK64
        z = self._state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        """An integer in ``[0, n)``."""
        return self.next_u64() % n

    def between(self, lo: int, hi: int) -> int:
        """An integer in ``[lo, hi]`` (both ends included)."""
        return lo + self.below(hi - lo + 1)

    def choice(self, items: Sequence[_T]) -> _T:
        return items[self.below(len(items))]

    def percent(self, p: int) -> bool:
        """True with probability ``p`` / 100."""
        return self.below(100) < p


# --- word lists (fixed; editing them changes every model) -----------------------------------


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


_PY_KEYWORDS = _words(
    "False None True and as assert async await break class continue def del elif else except "
    "finally for from global if import in is lambda nonlocal not or pass raise return try while "
    "with yield match case"
)
_PY_BUILTINS = _words(
    "print len range enumerate zip map filter sorted reversed isinstance issubclass getattr "
    "setattr hasattr super open list dict set tuple str int float bool bytes bytearray object "
    "type min max sum any all abs round iter next repr hash id format vars dir callable"
)
_PY_MODULES = _words(
    "os sys json re time math typing pathlib logging asyncio dataclasses functools itertools "
    "collections subprocess threading contextlib hashlib struct tempfile shutil unittest "
    "argparse socket signal enum abc uuid datetime random statistics textwrap numpy pytest grpc"
)
_JS_KEYWORDS = _words(
    "const let var function return if else for while do switch case break continue new this "
    "class extends import export default from async await try catch finally throw typeof "
    "instanceof null undefined true false of in yield static get set"
)
_JS_APIS = _words(
    "console.log console.error JSON.stringify JSON.parse Object.keys Object.entries Array.from "
    "Promise.all Promise.resolve fetch setTimeout clearTimeout Math.max Math.min Math.floor "
    "document.querySelector window.addEventListener process.env require module.exports"
)
_ID_PARTS = _words(
    "get set add remove update delete create build load save read write open close parse "
    "format render send receive handle process run start stop init reset check validate "
    "compute apply merge split join find search filter sort map reduce count index encode "
    "decode tokenize detokenize prefill decode evaluate stream flush fetch push pop "
    "user name id key value item items list dict map set config options settings path file "
    "dir root base node tree graph edge cache entry store buffer queue stack pool worker task "
    "job thread lock event state status result error errors message request response client "
    "server session prefix suffix token tokens model engine backend manifest digest hash "
    "context window batch size length offset limit count total max min first last next prev "
    "input output source target data payload header body chunk block page row column table "
    "record field schema type kind mode level timeout retry delay interval deadline owner "
    "lease fence epoch slot seq pos logits kv template prompt reply tool call args kwargs"
)
_ENGLISH = _words(
    "the of and to in is it that for on with as was this be by are not or at from have an "
    "but which can all were when we there their one has more will would if so about what "
    "some into other than then them these time only could new may also after should any "
    "first use way because each how most where before those both through between while "
    "change changes function value values test tests file files line lines code return "
    "returns error fails passes expected actual missing called used cache cached warm cold "
    "reuse prefix suffix context model server client request update fix add remove refactor "
    "rename move keep drop make sure never always again still already please note example "
    "small large fast slow simple clear correct wrong because therefore however instead "
    "without within against during across behind under over above below since until unless "
    "whether either neither several many few much little every another same different own "
    "user users developer project repository branch commit review merge release version "
    "build builds install configure run runs running started stopped finished waiting"
)
_FILE_DIRS = _words("src lib tests modeld server engine backends utils core api cli docs scripts")
_FILE_EXTS = _words(".py .py .py .js .ts .json .md .toml .yaml .txt .proto")
_SYLLABLES = (
    *(c + v for c in _words("b c d f g h j k l m n p r s t v w z ch sh th st tr") for v in "aeiou"),
    *_words("an en in on un ar er ir or ax ex ix ox ul el"),
)

_MULTILINGUAL = (
    "Déjà vu: le café est très chaud, n'est-ce pas ? Où est la bibliothèque ?",
    "Übermäßig große Änderungen führen zu Fehlern; prüfe die Größe der Datei.",
    "¿Dónde está el archivo? La configuración falló en la línea doce, señor.",
    "Não foi possível concluir a operação: verificação de integridade falhou.",
    "Tiếng Việt có dấu: người dùng đã cập nhật tệp cấu hình thành công.",
    "Ελληνικά: η συνάρτηση επιστρέφει μια τιμή. Русский: функция возвращает значение.",
    "Ça coûte 12,50 € — naïve façade, rôle, cœur, garçon, élève, Noël.",
    "Zażółć gęślą jaźń. Příliš žluťoučký kůň úpěl ďábelské ódy. Åsa och Öland.",
    "你好，世界！这个函数返回一个列表。缓存命中率很高，前缀没有变化。",
    "测试失败：期望值为三，实际值为四。请检查配置文件和日志。",
    "日本語のテキスト：キャッシュを再利用します。関数は値を返します。",
    "こんにちは、世界。東京は晴れです。エラーが発生しました。",
    "한국어 문장입니다. 캐시가 따뜻합니다. 테스트가 통과했습니다.",
    "العربية: مرحبا بالعالم. हिन्दी: नमस्ते दुनिया। עברית: שלום עולם.",
    "Emoji: 🎉 🚀 ✅ ❌ 🔥 👍 😀 😂 🤖 🧪 📦 🐍 ⚠️ 💡 👩\u200d💻 👨\u200d👩\u200d👧 🇫🇷 🇯🇵 👍🏽",
    "Math: α + β = γ, ∑ xᵢ ≤ ∞, √2 ≈ 1.414, ∀ x ∈ ℝ, → ← ⇒ ≠ ± × ÷ °C",
    "Box: ┌──┬──┐ │ok│ko│ └──┴──┘ • … “quoted” ‘single’ « guillemets » ™ © ®",
)
_EMOJI = tuple("🎉🚀✅❌🔥👍😀😂🤖🧪📦🐍💡🔧📝🐛✨🚧♻️")


# --- identifiers and small pieces -----------------------------------------------------------


def _pseudo_word(rng: SplitMix64) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.between(1, 3)))


def _parts(rng: SplitMix64, n: int) -> list[str]:
    # One part in four is a pseudo-word: keeps enough distinct words for a 32k vocabulary.
    return [_pseudo_word(rng) if rng.percent(25) else rng.choice(_ID_PARTS) for _ in range(n)]


def _snake(rng: SplitMix64) -> str:
    return "_".join(_parts(rng, rng.between(1, 3)))


def _camel(rng: SplitMix64) -> str:
    first, *rest = _parts(rng, rng.between(1, 3))
    return first + "".join(p.capitalize() for p in rest)


def _pascal(rng: SplitMix64) -> str:
    return "".join(p.capitalize() for p in _parts(rng, rng.between(1, 3)))


def _number(rng: SplitMix64) -> str:
    kind = rng.below(5)
    if kind == 0:
        return str(rng.below(10))
    if kind == 1:
        return str(rng.below(1000))
    if kind == 2:
        return f"{rng.below(100)}.{rng.below(1000):03d}"
    if kind == 3:
        return hex(rng.below(1 << 16))
    return str(rng.below(1 << 31))


def _sentence(rng: SplitMix64) -> str:
    words = [rng.choice(_ENGLISH) for _ in range(rng.between(4, 14))]
    words[0] = words[0].capitalize()
    if rng.percent(20):
        words.insert(rng.below(len(words)), f"`{_snake(rng)}`")
    return " ".join(words) + rng.choice((".", ".", ".", "?", "!", ":"))


def _path(rng: SplitMix64) -> str:
    dirs = [rng.choice(_FILE_DIRS) for _ in range(rng.between(0, 2))]
    return "/".join([*dirs, _snake(rng) + rng.choice(_FILE_EXTS)])


def _py_expr(rng: SplitMix64) -> str:
    kind = rng.below(8)
    if kind == 0:
        return f"{rng.choice(_PY_BUILTINS)}({_snake(rng)})"
    if kind == 1:
        return f"self.{_snake(rng)}"
    if kind == 2:
        return f'f"{{{_snake(rng)}}}: {rng.choice(_ENGLISH)} {{{_snake(rng)}!r}}"'
    if kind == 3:
        return f"{_snake(rng)}[{_number(rng)}]"
    if kind == 4:
        return f"{_snake(rng)} {rng.choice(('+', '-', '*', '//', '%', '==', '!=', '<='))} {_number(rng)}"
    if kind == 5:
        return f'"{rng.choice(_ENGLISH)} {rng.choice(_ENGLISH)}"'
    if kind == 6:
        return f"{_snake(rng)}.{_snake(rng)}({_snake(rng)}, {_snake(rng)}={_number(rng)})"
    return rng.choice(("None", "True", "False", "[]", "{}", "0", "1", "-1"))


# --- document generators --------------------------------------------------------------------


def _python_module(rng: SplitMix64) -> str:
    out = [f'"""{_sentence(rng)}"""', ""]
    for _ in range(rng.between(1, 4)):
        if rng.percent(50):
            out.append(f"import {rng.choice(_PY_MODULES)}")
        else:
            names = ", ".join(_snake(rng) for _ in range(rng.between(1, 3)))
            out.append(f"from {rng.choice(_PY_MODULES)} import {names}")
    out.append("")
    indent = ""
    if rng.percent(50):
        out += [
            "",
            f"class {_pascal(rng)}({rng.choice(('object', 'Exception', 'Protocol'))}):",
        ]
        out.append(f'    """{_sentence(rng)}"""')
        out.append("")
        indent = "    "
    for _ in range(rng.between(1, 3)):
        args = ", ".join(
            f"{_snake(rng)}: {rng.choice(('int', 'str', 'bytes', 'float', 'bool', 'list[str]', 'dict[str, int]', 'Path | None'))}"
            for _ in range(rng.between(0, 3))
        )
        if indent:
            args = "self, " + args if args else "self"
        ret = rng.choice(("None", "int", "str", "bool", "list[int]", "Iterator[str]"))
        prefix = "async def" if rng.percent(15) else "def"
        out.append(f"{indent}{prefix} {_snake(rng)}({args}) -> {ret}:")
        body = indent + "    "
        if rng.percent(60):
            out.append(f'{body}"""{_sentence(rng)}"""')
        for _ in range(rng.between(1, 6)):
            kind = rng.below(7)
            if kind == 0:
                out.append(f"{body}if {_py_expr(rng)}:")
                out.append(f"{body}    return {_py_expr(rng)}")
            elif kind == 1:
                out.append(f"{body}for {_snake(rng)} in {_py_expr(rng)}:")
                out.append(f"{body}    {_snake(rng)}.append({_py_expr(rng)})")
            elif kind == 2:
                out.append(f"{body}# {_sentence(rng)}")
            elif kind == 3:
                out += [f"{body}try:", f"{body}    {_snake(rng)} = {_py_expr(rng)}"]
                out += [
                    f"{body}except {_pascal(rng)}Error as exc:",
                    f"{body}    raise {_pascal(rng)}Error(str(exc)) from exc",
                ]
            elif kind == 4:
                out.append(f"{body}with open({_snake(rng)}, 'rb') as fh:")
                out.append(f"{body}    {_snake(rng)} = fh.read()")
            else:
                out.append(f"{body}{_snake(rng)} = {_py_expr(rng)}")
        out.append(f"{body}return {_py_expr(rng)}")
        out.append("")
    return "\n".join(out) + "\n"


def _javascript(rng: SplitMix64) -> str:
    out = []
    if rng.percent(50):
        out.append(f"import {{ {_camel(rng)}, {_camel(rng)} }} from './{_camel(rng)}.js';")
    for _ in range(rng.between(1, 3)):
        name, args = (
            _camel(rng),
            ", ".join(_camel(rng) for _ in range(rng.between(0, 3))),
        )
        head = rng.choice(
            (
                f"function {name}({args}) {{",
                f"const {name} = async ({args}) => {{",
                f"export function {name}({args}) {{",
            )
        )
        out.append(head)
        for _ in range(rng.between(1, 5)):
            kind = rng.below(5)
            if kind == 0:
                out.append(f"  const {_camel(rng)} = {rng.choice(_JS_APIS)}({_camel(rng)});")
            elif kind == 1:
                empty = rng.choice(("null", "undefined", "0", "''"))
                out.append(f"  if ({_camel(rng)} === {empty}) {{")
                out.append(f"    throw new Error(`{rng.choice(_ENGLISH)} ${{{_camel(rng)}}}`);")
                out.append("  }")
            elif kind == 2:
                out.append(
                    f"  for (const {_camel(rng)} of {_camel(rng)}) {{ {_camel(rng)}.push({_number(rng)}); }}"
                )
            elif kind == 3:
                out.append(f"  // {_sentence(rng)}")
            else:
                out.append(
                    f"  let {_camel(rng)} = await {_camel(rng)}.{_camel(rng)}({{ {_camel(rng)}: {_number(rng)} }});"
                )
        out.append(f"  return {_camel(rng)};")
        out.append("}")
        out.append("")
    return "\n".join(out) + "\n"


def _diff(rng: SplitMix64) -> str:
    path = _path(rng)
    a, b = rng.below(400) + 1, rng.below(400) + 1
    out = [
        f"diff --git a/{path} b/{path}",
        f"index {rng.next_u64() & 0xFFFFFFF:07x}..{rng.next_u64() & 0xFFFFFFF:07x} 100644",
        f"--- a/{path}",
        f"+++ b/{path}",
        f"@@ -{a},{rng.between(3, 9)} +{b},{rng.between(3, 9)} @@ def {_snake(rng)}(",
    ]
    for _ in range(rng.between(3, 10)):
        mark = rng.choice((" ", " ", "-", "+"))
        out.append(f"{mark}    {_snake(rng)} = {_py_expr(rng)}")
    return "\n".join(out) + "\n"


def _pytest_output(rng: SplitMix64) -> str:
    n_pass, n_fail = rng.below(40), rng.below(4)
    test_file = f"tests/test_{_snake(rng)}.py"
    out = [
        "============================= test session starts ==============================",
        f"platform linux -- Python 3.{rng.between(9, 13)}.{rng.below(10)}, pytest-{rng.between(7, 9)}.{rng.below(5)}.0",
        f"collected {n_pass + n_fail} items",
        "",
        f"{test_file} {'.' * n_pass}{'F' * n_fail}{' ' * rng.below(8)}[100%]",
    ]
    for _ in range(n_fail):
        name = f"test_{_snake(rng)}"
        out += [
            "",
            f"___________________________ {name} ___________________________",
            "",
            f"    def {name}() -> None:",
            f">       assert {_snake(rng)}({_number(rng)}) == {_number(rng)}",
            f"E       AssertionError: assert {_number(rng)} == {_number(rng)}",
            "",
            f"{test_file}:{rng.between(5, 300)}: AssertionError",
        ]
    out.append(f"FAILED {test_file}::test_{_snake(rng)} - {_pascal(rng)}Error: {_sentence(rng)}")
    out.append(
        f"========================= {n_fail} failed, {n_pass} passed in {rng.below(30)}.{rng.below(100):02d}s ========================="
    )
    return "\n".join(out) + "\n"


def _json_value(rng: SplitMix64, depth: int) -> str:
    kind = rng.below(7 if depth < 3 else 5)
    if kind == 0:
        return _number(rng)
    if kind == 1:
        return rng.choice(("true", "false", "null"))
    if kind in (2, 3, 4):
        text = rng.choice((_snake(rng), _sentence(rng), _path(rng), rng.choice(_MULTILINGUAL)[:24]))
        return '"' + text.replace('"', '\\"') + '"'
    if kind == 5:
        return "[" + ", ".join(_json_value(rng, depth + 1) for _ in range(rng.between(0, 4))) + "]"
    return _json_object(rng, depth + 1)


def _json_object(rng: SplitMix64, depth: int) -> str:
    pad, inner = "  " * depth, "  " * (depth + 1)
    items = [f'{inner}"{_camel(rng)}": {_json_value(rng, depth)}' for _ in range(rng.between(1, 5))]
    return "{\n" + ",\n".join(items) + "\n" + pad + "}"


def _json_doc(rng: SplitMix64) -> str:
    return _json_object(rng, 0) + "\n"


def _shell_and_make(rng: SplitMix64) -> str:
    out = [
        f"$ git {rng.choice(('status', 'diff --stat', 'log --oneline -5', 'add -p', 'commit -m'))}",
        f"$ {rng.choice(('ls -la', 'cat', 'rg', 'python -m pytest -q', 'make test', 'cd'))} {_path(rng)}",
        f"{_snake(rng)}:\t{_path(rng)}",
        f"\t$(PYTHON) -m {rng.choice(_PY_MODULES)} {_path(rng)}",
        f'\t@echo "{_sentence(rng)}"',
        f"{_snake(rng).upper()}\t=\t{_number(rng)}\t# {rng.choice(_ENGLISH)}",
        f"  \t  {_snake(rng)}   {_snake(rng)}\t\t{_number(rng)}",
    ]
    return "\n".join(out[: rng.between(2, len(out))]) + "\n"


def _prose(rng: SplitMix64) -> str:
    out = [f"{'#' * rng.between(1, 3)} {_sentence(rng)}", ""]
    out += [" ".join(_sentence(rng) for _ in range(rng.between(1, 4))), ""]
    for _ in range(rng.below(4)):
        out.append(f"- {_sentence(rng)}")
    if rng.percent(30):
        out += ["", "```python", f"{_snake(rng)} = {_py_expr(rng)}", "```"]
    return "\n".join(out) + "\n\n"


def _multilingual(rng: SplitMix64) -> str:
    out = [rng.choice(_MULTILINGUAL) for _ in range(rng.between(1, 3))]
    if rng.percent(50):
        out.append(
            f'# {rng.choice(_MULTILINGUAL)}\n{_snake(rng)} = "{rng.choice(_EMOJI)} {rng.choice(_MULTILINGUAL)[:16]}"'
        )
    return "\n".join(out) + "\n"


_GENERATORS: tuple[tuple[int, Callable[[SplitMix64], str]], ...] = (
    (30, _python_module),
    (12, _javascript),
    (12, _diff),
    (8, _pytest_output),
    (10, _json_doc),
    (8, _shell_and_make),
    (10, _prose),
    (10, _multilingual),
)
_TOTAL_WEIGHT = sum(w for w, _ in _GENERATORS)


def build_corpus(seed: int, n_chars: int) -> list[str]:
    """Documents totalling at least ``n_chars`` characters, a pure function of the arguments."""
    rng = SplitMix64(seed)
    docs: list[str] = []
    total = 0
    while total < n_chars:
        doc = _pick_generator(rng)(rng)
        docs.append(doc)
        total += len(doc)
    return docs


def _pick_generator(rng: SplitMix64) -> Callable[[SplitMix64], str]:
    pick = rng.below(_TOTAL_WEIGHT)
    for weight, generate in _GENERATORS:
        if pick < weight:
            return generate
        pick -= weight
    raise AssertionError("unreachable: weights sum to _TOTAL_WEIGHT")
