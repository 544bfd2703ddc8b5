# ruff: noqa: RUF001, RUF003 - DeepSeek's tokens are written with fullwidth bars (｜), as its vocabulary has them
"""Chat templates of the Gemma, GLM, DeepSeek and Kimi families, written here.

As in :mod:`modeld.testmodels._families_a`: each reproduces its family's rules (special tokens,
fields read, what it renders otherwise once more turns follow, what it refuses, tool-call and
reasoning markup) in this project's own text.
"""

from __future__ import annotations

from typing import Final

__all__ = ["DEEPSEEK_R1", "DEEPSEEK_V31", "GEMMA3", "GEMMA4", "GLM46", "KIMI_K2"]

# Gemma 3: BOS; no system turn (the system text opens the first user turn); roles must
# alternate user/model (a tool result breaks that: refused); no tools; contents trimmed.
GEMMA3: Final = r"""{{- bos_token }}
{%- if messages[0].role == 'system' %}
{%- set first = (messages[0].content if messages[0].content is string else messages[0].content[0].text) + '\n\n' %}
{%- set rest = messages[1:] %}
{%- else %}{%- set first = '' %}{%- set rest = messages %}{%- endif %}
{%- for m in rest %}
{%- if (m.role == 'user') != (loop.index0 % 2 == 0) %}{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}
{{- '<start_of_turn>' + ('model' if m.role == 'assistant' else m.role) + '\n' + (first if loop.first else '') }}
{%- if m.content is string %}{{- m.content | trim }}{%- else %}{%- for p in m.content %}{%- if p.type == 'text' %}{{- p.text | trim }}{%- endif %}{%- endfor %}{%- endif %}
{{- '<end_of_turn>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<start_of_turn>model\n' }}{%- endif %}
"""

# Gemma 4: BOS; a system turn when there is a system message, tools or thinking (<|think|> at
# its top); tools declared in <|tool>...<tool|>; a call is <|tool_call>call:NAME{k:v,...}<tool_call|>
# (keys sorted, strings quoted with <|"|>); an assistant call looks AHEAD and writes the
# results of the tool messages after it inside its own turn (so it renders otherwise once
# they exist); reasoning shows only on a call after the last user turn; the generation prompt
# closes an empty thought channel unless thinking is on; no generation prompt right after a
# call or a result (the model continues its turn). Its first line says it takes OpenAI-style
# tool messages (llama-server rewrites the messages of Gemma 4 templates that do not say so).
GEMMA4: Final = r"""{#- OpenAI Chat Completions: a call's results are role tool messages after it -#}
{%- macro arg(v) %}
{%- if v is string %}{{- '<|"|>' + v + '<|"|>' }}
{%- elif v is mapping %}{{- '{' }}{%- for k, x in v | dictsort %}{{- k + ':' + arg(x) }}{%- if not loop.last %},{% endif %}{%- endfor %}{{- '}' }}
{%- elif v is sequence %}{{- '[' }}{%- for x in v %}{{- arg(x) }}{%- if not loop.last %},{% endif %}{%- endfor %}{{- ']' }}
{%- else %}{{- v | tojson }}{%- endif %}
{%- endmacro %}
{%- set ns = namespace(last=None) %}
{%- set rest = messages %}
{{- bos_token }}
{%- if (enable_thinking is defined and enable_thinking) or tools or messages[0].role in ['system', 'developer'] %}
{{- '<|turn>system\n' }}
{%- if enable_thinking is defined and enable_thinking %}{{- '<|think|>\n' }}{%- endif %}
{%- if messages[0].role in ['system', 'developer'] %}{{- messages[0].content | trim }}{%- set rest = messages[1:] %}{%- endif %}
{%- for t in tools or [] %}{%- set f = t.function if t.function is defined else t %}
{{- '<|tool>declaration:' + f.name + '{description:' + arg(f.description or '') + ',parameters:' + arg(f.parameters or {}) + '}<tool|>' }}
{%- endfor %}
{{- '<turn|>\n' }}
{%- endif %}
{%- set q = namespace(user=-1) %}
{%- for i in range(rest | length) %}{%- if rest[i].role == 'user' %}{%- set q.user = i %}{%- endif %}{%- endfor %}
{%- for m in rest %}
{%- if m.role != 'tool' %}
{%- set ns.last = None %}
{{- '<|turn>' + ('model' if m.role == 'assistant' else m.role) + '\n' }}
{%- set thought = m.get('reasoning_content') %}
{%- if thought and loop.index0 > q.user and m.get('tool_calls') %}{{- '<|channel>thought\n' + thought + '\n<channel|>' }}{%- endif %}
{%- set out = namespace(results=false) %}
{%- for call in m.get('tool_calls') or [] %}
{{- '<|tool_call>call:' + call.function.name + '{' }}
{%- if call.function.arguments is mapping %}{%- for k, v in call.function.arguments | dictsort %}{{- k + ':' + arg(v) }}{%- if not loop.last %},{% endif %}{%- endfor %}
{%- else %}{{- call.function.arguments }}{%- endif %}
{{- '}<tool_call|>' }}{%- set ns.last = 'call' %}
{%- endfor %}
{%- if m.get('tool_calls') %}
{%- set scan = namespace(stop=false) %}
{%- for k in range(loop.index0 + 1, rest | length) %}
{%- if scan.stop or rest[k].role != 'tool' %}{%- set scan.stop = true %}
{%- else %}
{%- set name = namespace(v=rest[k].get('name') or 'unknown') %}
{%- for call in m.tool_calls %}{%- if call.get('id') == rest[k].get('tool_call_id') %}{%- set name.v = call.function.name %}{%- endif %}{%- endfor %}
{{- '<|tool_response>response:' + name.v + '{value:' + arg(rest[k].content) + '}<tool_response|>' }}
{%- set out.results = true %}{%- set ns.last = 'result' %}
{%- endif %}
{%- endfor %}
{%- endif %}
{%- if m.content is string %}{{- m.content | trim }}{%- endif %}
{%- if ns.last == 'call' and not out.results %}{{- '<|tool_response>' }}
{%- elif not (out.results and not m.content) %}{{- '<turn|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt and ns.last not in ['call', 'result'] %}
{{- '<|turn>model\n' }}
{%- if not (enable_thinking | default(false)) %}{{- '<|channel>thought\n<channel|>' }}{%- endif %}
{%- endif %}
"""

# GLM 4.5/4.6: [gMASK]<sop>; tools as JSON lines (tojson with ensure_ascii=False); turns
# <|system|>, <|user|>, <|assistant|>, results grouped under <|observation|> in
# <tool_response>; reasoning kept in <think> only after the last user turn (else an empty
# <think></think>); a call is <tool_call>NAME then <arg_key>K</arg_key><arg_value>V</arg_value>
# (arguments must be an object: refused otherwise); thinking off appends /nothink to every user
# turn and closes the think block in the generation prompt.
GLM46: Final = r"""[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools

You may call functions to help with the request. Their signatures, in <tools></tools>:
<tools>
{% for t in tools %}
{{ t | tojson(ensure_ascii=False) }}
{% endfor %}
</tools>

For each call, write the name and arguments as:
<tool_call>{function-name}
<arg_key>{arg-key}</arg_key>
<arg_value>{arg-value}</arg_value>
</tool_call>{%- endif -%}
{%- macro text(c) -%}{%- if c is string -%}{{- c }}{%- elif c is iterable and c is not mapping -%}{%- for p in c -%}{%- if p is mapping and p.type == 'text' -%}{{- p.text }}{%- endif -%}{%- endfor -%}{%- else -%}{{- c }}{%- endif -%}{%- endmacro -%}
{%- set ns = namespace(user=-1) %}
{%- for m in messages %}{%- if m.role == 'user' %}{% set ns.user = loop.index0 -%}{%- endif %}{%- endfor %}
{% for m in messages %}
{%- if m.role == 'user' -%}<|user|>
{{ text(m.content) }}
{{- '/nothink' if (enable_thinking is defined and not enable_thinking and not text(m.content).endswith('/nothink')) else '' -}}
{%- elif m.role == 'assistant' -%}
<|assistant|>
{%- set content = text(m.content) %}{%- set thought = '' %}
{%- if m.reasoning_content is string %}{%- set thought = m.reasoning_content %}
{%- elif '</think>' in content %}
{%- set thought = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\n') %}
{%- endif %}
{%- if loop.index0 > ns.user and thought -%}{{ '\n<think>' + thought.strip() + '</think>' }}{%- else -%}{{ '\n<think></think>' }}{%- endif -%}
{%- if content.strip() -%}{{ '\n' + content.strip() }}{%- endif -%}
{% if m.tool_calls %}
{% for call in m.tool_calls %}{%- set f = call.function if call.function else call %}
{{ '\n<tool_call>' + f.name }}
{% set args = f.arguments or {} %}
{% if args is not mapping %}{{ raise_exception('Invalid tool call arguments passed: ' + args | string) }}{% endif %}
{% for k, v in args.items() %}
<arg_key>{{ k }}</arg_key>
<arg_value>{{ v | tojson(ensure_ascii=False) if v is not string else v }}</arg_value>
{% endfor %}
</tool_call>{% endfor %}
{% endif %}
{%- elif m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|observation|>' }}{%- endif %}
{{- '\n<tool_response>\n' + m.content + '\n</tool_response>' }}
{%- elif m.role == 'system' -%}
<|system|>
{{ text(m.content) }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|assistant|>{{- '\n<think></think>' if (enable_thinking is defined and not enable_thinking) else '' -}}{%- endif -%}
"""

# DeepSeek R1 (distilled): BOS then the system text bare; <｜User｜> and <｜Assistant｜> turns
# ending with <｜end▁of▁sentence｜>; an assistant turn drops what precedes </think>; calls in
# <｜tool▁calls▁begin｜> with a ```json block of tojson'd arguments; results in
# <｜tool▁outputs▁begin｜>; the generation prompt opens <think> (closed at once unless
# enable_thinking), and none follows tool outputs.
DEEPSEEK_R1: Final = r"""{%- set ns = namespace(first=false, tool=false, output_first=true, system='') -%}
{%- for m in messages -%}{%- if m.role == 'system' -%}{%- set ns.system = m.content -%}{%- endif -%}{%- endfor -%}
{{- bos_token }}{{ ns.system }}
{%- for m in messages -%}
{%- if m.role == 'user' -%}{%- set ns.tool = false -%}{{- '<｜User｜>' + m.content }}{%- endif -%}
{%- if m.role == 'assistant' and m.tool_calls -%}
{%- set ns.tool = false -%}
{%- for call in m.tool_calls -%}
{{- ('<｜Assistant｜><｜tool▁calls▁begin｜>' if not ns.first else '\n') + '<｜tool▁call▁begin｜>' + call.type + '<｜tool▁sep｜>' + call.function.name + '\n```json\n' + call.function.arguments | tojson + '\n```<｜tool▁call▁end｜>' }}
{%- set ns.first = true -%}
{%- endfor -%}
{{- '<｜tool▁calls▁end｜><｜end▁of▁sentence｜>' }}
{%- endif -%}
{%- if m.role == 'assistant' and m.content -%}
{%- if ns.tool -%}{{- '<｜tool▁outputs▁end｜>' + m.content + '<｜end▁of▁sentence｜>' }}{%- set ns.tool = false -%}
{%- else -%}{{- '<｜Assistant｜>' + m.content.split('</think>')[-1] + '<｜end▁of▁sentence｜>' }}{%- endif -%}
{%- endif -%}
{%- if m.role == 'tool' -%}
{%- set ns.tool = true -%}
{{- ('<｜tool▁outputs▁begin｜>' if ns.output_first else '\n') + '<｜tool▁output▁begin｜>' + m.content + '<｜tool▁output▁end｜>' }}
{%- set ns.output_first = false -%}
{%- endif -%}
{%- endfor -%}
{%- if ns.tool -%}{{- '<｜tool▁outputs▁end｜>' }}{%- endif -%}
{%- if add_generation_prompt and not ns.tool -%}{{- '<｜Assistant｜><think>\n' }}{%- if not enable_thinking %}{{- '</think>' }}{%- endif %}{%- endif %}
"""

# DeepSeek V3.1: every system message (wherever it stands) is gathered at the top, so a system
# message added later re-renders the start; <think></think> after the assistant marker unless
# thinking; calls NAME<｜tool▁sep｜>ARGS (tojson) in <｜tool▁calls▁begin｜>; results in
# <｜tool▁output▁begin｜>; no generation prompt after a tool result (the turn continues).
DEEPSEEK_V31: Final = r"""{%- if not thinking is defined -%}{%- set thinking = enable_thinking if enable_thinking is defined else false -%}{%- endif -%}
{%- set ns = namespace(first=false, tool=false, system='', first_sp=true, last_user=false) -%}
{%- for m in messages -%}{%- if m.role == 'system' -%}
{%- set ns.system = ns.system + ('' if ns.first_sp else '\n\n') + m.content -%}{%- set ns.first_sp = false -%}
{%- endif -%}{%- endfor -%}
{{- bos_token }}{{ ns.system }}
{%- for m in messages -%}
{%- if m.role == 'user' -%}{%- set ns.tool = false -%}{%- set ns.first = false -%}{%- set ns.last_user = true -%}{{- '<｜User｜>' + m.content }}{%- endif -%}
{%- if m.role == 'assistant' and m.tool_calls -%}
{%- if ns.last_user -%}{{- '<｜Assistant｜><think></think>' }}{%- endif -%}
{%- set ns.last_user = false -%}{%- set ns.first = false -%}{%- set ns.tool = false -%}
{%- for call in m.tool_calls -%}
{{- ((m.content or '') + '<｜tool▁calls▁begin｜>' if not ns.first else '') + '<｜tool▁call▁begin｜>' + call.function.name + '<｜tool▁sep｜>' + call.function.arguments | tojson + '<｜tool▁call▁end｜>' }}
{%- set ns.first = true -%}
{%- endfor -%}
{{- '<｜tool▁calls▁end｜><｜end▁of▁sentence｜>' }}
{%- endif -%}
{%- if m.role == 'assistant' and not m.tool_calls -%}
{%- if ns.last_user -%}{{- '<｜Assistant｜><think></think>' }}{%- endif -%}
{%- set ns.last_user = false -%}
{%- if ns.tool -%}{{- m.content + '<｜end▁of▁sentence｜>' }}{%- set ns.tool = false -%}
{%- else -%}{{- (m.content.split('</think>', 1)[1] if '</think>' in m.content else m.content) + '<｜end▁of▁sentence｜>' }}{%- endif -%}
{%- endif -%}
{%- if m.role == 'tool' -%}{%- set ns.last_user = false -%}{%- set ns.tool = true -%}{{- '<｜tool▁output▁begin｜>' + m.content + '<｜tool▁output▁end｜>' }}{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt and ns.last_user and not ns.tool -%}{{- '<｜Assistant｜>' + ('<think>' if thinking else '<think></think>') }}{%- endif %}
"""

# Kimi K2 (thinking): the tool declaration comes first, before the system turn (a default one
# when there is none); roles <|im_user|>, <|im_assistant|>, <|im_system|> (a message's name, if
# any, replaces the role's); call ids are rewritten functions.NAME:N in order and results take
# them from a queue (list append/pop); reasoning is shown only after the last assistant answer
# that is not a call (found with a loop that breaks), earlier turns get an empty <think></think>.
KIMI_K2: Final = r"""{%- macro text(m) -%}
{%- set c = m.get('content') -%}
{%- if c is string -%}{{ c }}{%- elif c is not none -%}{%- for p in c -%}{{ p['text'] }}{%- endfor -%}{%- endif -%}
{%- endmacro -%}
{%- macro head(m) -%}
{%- set who = m.get('name') or m['role'] -%}
{%- if m['role'] == 'user' -%}<|im_user|>{{ who }}<|im_middle|>
{%- elif m['role'] == 'assistant' -%}<|im_assistant|>{{ who }}<|im_middle|>
{%- else -%}<|im_system|>{{ who }}<|im_middle|>{%- endif -%}
{%- endmacro -%}
{%- set queue = namespace(ids=[]) -%}
{%- set counter = namespace(n=0) -%}
{%- macro calls(m) -%}
<|tool_calls_section_begin|>
{%- for call in m['tool_calls'] -%}
{%- set id = 'functions.' + call['function']['name'] + ':' + (counter.n | string) -%}
{%- set counter.n = counter.n + 1 -%}
{%- set _ = queue.ids.append(id) -%}
<|tool_call_begin|>{{ id }}<|tool_call_argument_begin|>{% if call['function']['arguments'] is string %}{{ call['function']['arguments'] }}{% else %}{{ call['function']['arguments'] | tojson }}{% endif %}<|tool_call_end|>
{%- endfor -%}
<|tool_calls_section_end|>
{%- endmacro -%}
{%- set ns = namespace(answer=-1) -%}
{%- for i in range(messages | length - 1, -1, -1) -%}
{%- if messages[i]['role'] == 'assistant' and not messages[i].get('tool_calls') -%}{%- set ns.answer = i -%}{% break %}{%- endif -%}
{%- endfor -%}
{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}
{%- if messages | length == 0 or messages[0]['role'] != 'system' -%}<|im_system|>system<|im_middle|>You are Kimi, an assistant made by Moonshot AI.<|im_end|>{%- endif -%}
{%- for m in messages -%}
{{ head(m) }}
{%- if m['role'] == 'assistant' -%}
<think>{{ m.get('reasoning_content', '') if loop.index0 > ns.answer else '' }}</think>{{ text(m) }}
{%- if m.get('tool_calls') -%}{{ calls(m) }}{%- endif -%}
{%- elif m['role'] == 'tool' -%}
{%- set id = queue.ids.pop(0) if queue.ids else 'functions.' + m.get('name', 'unknown') + ':' + (counter.n | string) -%}
## Return of {{ id }}
{{ text(m) }}
{%- elif m['content'] is not none -%}{{ text(m) }}
{%- endif -%}
<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}
"""
