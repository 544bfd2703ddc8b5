"""Chat templates of the MiniMax, LFM2, Nemotron, Seed-OSS, Granite and Command R families,
written here.

As in :mod:`modeld.testmodels._families_a`: each reproduces its family's rules (special tokens,
fields read, what it renders otherwise once more turns follow, what it refuses, tool-call and
reasoning markup) in this project's own text.
"""

from __future__ import annotations

from typing import Final

__all__ = ["COMMAND_R", "GRANITE", "LFM2", "MINIMAX_M2", "NEMOTRON", "SEED_OSS"]

# MiniMax M2: ]~!b[ then ]~b]ROLE turns ending [e~[; tools as <tool> JSON lines (ensure_ascii
# False) in the system turn; a call is <minimax:tool_call><invoke name=N><parameter name=K>V
# </parameter></invoke></minimax:tool_call> (arguments an object: ``.items()``); a tool result
# needs an assistant call before it (refused otherwise); reasoning shown after the last user
# turn only; the generation prompt opens <think>.
MINIMAX_M2: Final = r"""{%- macro text(c) -%}{%- if c is string -%}{{ c }}{%- elif c is iterable and c is not mapping -%}{%- for p in c -%}{%- if p is mapping and p.type == 'text' -%}{{- p.text }}{%- endif -%}{%- endfor -%}{%- else -%}{{- c }}{%- endif -%}{%- endmacro -%}
{%- set system = messages[0] if messages and messages[0].role == 'system' else none -%}
{%- set rest = messages[1:] if system else messages -%}
{%- set ns = namespace(user=-1) %}
{%- for m in rest %}{%- if m.role == 'user' %}{% set ns.user = loop.index0 -%}{%- endif %}{%- endfor %}
{{- ']~!b[' ~ ']~b]system' ~ '\n' }}
{{- text(system.content) if system and system.content else (model_identity if model_identity is defined else 'You are a helpful assistant.') }}
{%- if tools -%}
{{- '\n\n# Tools\nYou may call tools to help with the request. The tools, in JSONSchema:\n\n<tools>\n' }}
{%- for t in tools -%}<tool>{{ t.function | tojson(ensure_ascii=False) }}</tool>
{% endfor -%}
{{- '</tools>\n\nCall tools in XML:\n\n<minimax:tool_call>\n<invoke name="tool-name">\n<parameter name="param-key">param-value</parameter>\n</invoke>\n</minimax:tool_call>' }}
{%- endif -%}
{{- '[e~[\n' }}
{%- set last = namespace(name=none) -%}
{%- for m in rest -%}
{%- if m.role == 'assistant' -%}
{{- ']~b]ai\n' }}
{%- set content = text(m.content) %}{%- set thought = '' %}
{%- if m.reasoning_content is string %}{%- set thought = m.reasoning_content %}
{%- elif '</think>' in content %}
{%- set thought = content.split('</think>')[0].strip('\n').split('<think>')[-1].strip('\n') %}
{%- set content = content.split('</think>')[-1].strip('\n') %}
{%- endif %}
{%- if thought and loop.index0 > ns.user -%}{{- '<think>\n' ~ thought ~ '\n</think>\n\n' }}{%- endif -%}
{{- content }}
{%- if m.tool_calls -%}
{{- '\n<minimax:tool_call>\n' }}
{%- for call in m.tool_calls -%}{%- set f = call.function if call.function else call %}
{{- '<invoke name="' + f.name + '">' }}
{%- for k, v in f.arguments.items() %}{{- '<parameter name="' + k + '">' + (v | tojson(ensure_ascii=False) if v is not string else v) + '</parameter>' }}{% endfor %}
{{- '</invoke>\n' }}
{%- endfor -%}
{{- '</minimax:tool_call>' }}{%- set last.name = m.tool_calls[-1].function.name -%}
{%- else -%}{%- set last.name = none -%}{%- endif -%}
{{- '[e~[\n' }}
{%- elif m.role == 'tool' -%}
{%- if last.name is none -%}{{- raise_exception('Message has tool role, but there was no previous assistant message with a tool call!') }}{%- endif -%}
{%- if loop.first or rest[loop.index0 - 1].role != 'tool' -%}{{- ']~b]tool' }}{%- endif -%}
{{- '\n<response>' + text(m.content) + '</response>' }}
{%- if loop.last or rest[loop.index0 + 1].role != 'tool' -%}{{- '[e~[\n' }}{%- endif -%}
{%- elif m.role == 'user' -%}{{- ']~b]user\n' + text(m.content) + '[e~[\n' }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- ']~b]ai\n<think>\n' }}{%- endif -%}
"""

# LFM2: BOS; ChatML turns; the tools, as a JSON list between <|tool_list_start|> and
# <|tool_list_end|>, follow the system text in the system turn; a tool result is wrapped in
# <|tool_response_start|>...<|tool_response_end|>; content that is not a string is tojson'd; an
# assistant's calls are written in its content by the model (Pythonic calls between
# <|tool_call_start|> and <|tool_call_end|>): the template shows only the content.
LFM2: Final = r"""{{- bos_token -}}
{%- set ns = namespace(system='') -%}
{%- if messages[0]['role'] == 'system' -%}{%- set ns.system = messages[0]['content'] -%}{%- set messages = messages[1:] -%}{%- endif -%}
{%- if tools -%}
{%- set ns.system = ns.system + ('\n' if ns.system else '') + 'List of tools: <|tool_list_start|>[' -%}
{%- for t in tools -%}{%- set ns.system = ns.system + (t if t is string else t | tojson) + (', ' if not loop.last else '') -%}{%- endfor -%}
{%- set ns.system = ns.system + ']<|tool_list_end|>' -%}
{%- endif -%}
{%- if ns.system -%}{{- '<|im_start|>system\n' + ns.system + '<|im_end|>\n' -}}{%- endif -%}
{%- for m in messages -%}
{{- '<|im_start|>' + m['role'] + '\n' -}}
{%- set content = m['content'] if m['content'] is string else m['content'] | tojson -%}
{%- if m['role'] == 'tool' -%}{%- set content = '<|tool_response_start|>' + content + '<|tool_response_end|>' -%}{%- endif -%}
{{- content + '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""

# Nemotron Nano v2: <SPECIAL_10>System, <SPECIAL_11>User / Assistant, turns end <SPECIAL_12>;
# /think and /no_think in a user or system message switch thinking (removed from the text);
# tools as a JSON list in <AVAILABLE_TOOLS>; calls <TOOLCALL>[{...}]</TOOLCALL>; results
# <TOOL_RESPONSE>; a trailing assistant turn is set apart and rendered with <think> opened
# (messages[-1] must exist: a system message alone is refused); earlier answers drop their
# reasoning; the generation prompt opens <think> (or an empty one when thinking is off).
NEMOTRON: Final = r"""{%- set ns = namespace(thinking=true) -%}
{%- for m in messages -%}{%- if m.role in ['user', 'system'] -%}
{%- if '/think' in m.content -%}{%- set ns.thinking = true -%}{%- elif '/no_think' in m.content -%}{%- set ns.thinking = false -%}{%- endif -%}
{%- endif -%}{%- endfor -%}
{%- if enable_thinking is defined and enable_thinking is false -%}{%- set ns.thinking = false -%}{%- endif -%}
{%- set system = (messages[0].content | default('', true)).replace('/think', '').replace('/no_think', '').strip() if messages[0].role == 'system' else '' -%}
{{- '<SPECIAL_10>System\n' + system -}}
{%- if tools -%}
{{- ('\n' if system else '') + 'You can use these tools if required:\n<AVAILABLE_TOOLS>[' -}}
{%- for t in tools -%}{{- (t.function if t.function is defined else t) | tojson -}}{{- ', ' if not loop.last else '' -}}{%- endfor -%}
{{- ']</AVAILABLE_TOOLS>\nTo call tools write: <TOOLCALL>[{"name": "tool_name", "arguments": {...}}]</TOOLCALL>' -}}
{%- endif -%}
{{- '\n' -}}
{%- set messages = messages[1:] if messages[0].role == 'system' else messages -%}
{%- set tail = namespace(content=none, calls=[]) -%}
{%- if messages[-1]['role'] == 'assistant' -%}
{%- set tail.content = (messages[-1].content | default('', true)).strip() -%}{%- set tail.calls = messages[-1].tool_calls or [] -%}
{%- set messages = messages[:-1] -%}
{%- endif -%}
{%- macro calls(list) -%}<TOOLCALL>[{%- for c in list -%}{{- '{"name": "' + c.function.name + '", "arguments": ' + c.function.arguments | tojson + '}' -}}{{- ', ' if not loop.last else '' -}}{%- endfor -%}]</TOOLCALL>{%- endmacro -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}{{- '<SPECIAL_11>User\n' + (m.content | default('', true)).replace('/think', '').replace('/no_think', '').strip() + '\n' -}}
{%- elif m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<SPECIAL_11>User\n<TOOL_RESPONSE>[' -}}{%- endif -%}
{{- m.content -}}{{- ', ' if not loop.last and messages[loop.index0 + 1].role == 'tool' else ']</TOOL_RESPONSE>\n' -}}
{%- elif m.role == 'assistant' -%}
{%- set content = (m.content | default('', true)) -%}
{%- if '</think>' in content -%}{%- set content = (content.split('</think>')[1] | default('', true)).strip() -%}{%- endif -%}
{{- '<SPECIAL_11>Assistant\n' + content.strip() -}}{%- if m.tool_calls -%}{{- calls(m.tool_calls) -}}{%- endif -%}{{- '\n<SPECIAL_12>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if tail.content is not none -%}
{{- '<SPECIAL_11>Assistant\n' + ('<think></think>' if not ns.thinking else '<think>\n') + tail.content -}}
{%- if tail.calls -%}{{- calls(tail.calls) -}}{%- endif -%}
{{- '\n<SPECIAL_12>\n' -}}
{%- endif -%}
{%- if add_generation_prompt -%}{{- '<SPECIAL_11>Assistant\n' + ('<think></think>' if not ns.thinking else '<think>\n') -}}{%- endif -%}
"""

# Seed-OSS: every turn is <seed:bos>ROLE ... <seed:eos>; tools as Python signatures in the
# system turn; an assistant keeps its reasoning in <seed:think> in every turn (none dropped);
# a call is <seed:tool_call><function=N><parameter=K>V</parameter></function></seed:tool_call>
# (arguments an object: ``|items``); a thinking budget of 0 adds a system turn and closes the
# think block in the generation prompt.
SEED_OSS: Final = (
    r"""{%- macro py(t) -%}{{- {'string': 'str', 'number': 'float', 'integer': 'int', 'boolean': 'bool', 'array': 'list', 'object': 'dict'}.get(t, 'Any') -}}{%- endmacro -%}
{%- set rest = messages[1:] if messages and messages[0].role == 'system' else messages -%}
{%- if messages and messages[0].role == 'system' or tools -%}
{{- bos_token + 'system\n' }}
{%- if messages and messages[0].role == 'system' %}{{- messages[0].content + ('\n\n' if tools else '') }}{%- endif %}
{%- for t in tools or [] if t.type == 'function' %}
{{- 'Function:\ndef ' + t.function.name + '(' }}
{%- for name, spec in (t.function.parameters.properties or {}).items() %}{{- name + ': ' + py(spec.type) }}{%- if not loop.last %}, {% endif %}{%- endfor %}
{{- '):\n    """
    " + (t.function.description or "
    ") | trim + "
    """\n' }}
{%- endfor %}
{%- if tools %}{{- 'To call a function, write:\n<seed:tool_call>\n<function=example_function_name>\n<parameter=example_parameter>value</parameter>\n</function>\n</seed:tool_call>' }}{%- endif %}
{{- eos_token }}
{%- endif -%}
{%- if thinking_budget is defined and thinking_budget == 0 -%}{{- bos_token + 'system\nAnswer at once, without thinking.' + eos_token }}{%- endif -%}
{%- for m in rest -%}
{%- if m.role == 'assistant' -%}
{{- bos_token + 'assistant' }}
{%- if m.reasoning_content is string and m.reasoning_content | trim %}{{- '\n<seed:think>' + m.reasoning_content | trim + '</seed:think>' }}{%- endif %}
{%- if m.content is string and m.content | trim %}{{- '\n' + m.content | trim + ('\n' if m.tool_calls else '') }}{%- endif %}
{%- for call in m.tool_calls or [] %}{%- set f = call.function if call.function is defined else call %}
{{- '\n<seed:tool_call>\n<function=' + f.name + '>\n' }}
{%- for k, v in f.arguments | items %}{{- '<parameter=' + k + '>' + (v if v is string else v | string) + '</parameter>\n' }}{%- endfor %}
{{- '</function>\n</seed:tool_call>' }}
{%- endfor %}
{{- eos_token }}
{%- else -%}{{- bos_token + m.role + '\n' + m.content + eos_token }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- bos_token + 'assistant\n' }}
{%- if thinking_budget is defined and thinking_budget == 0 %}{{- '<seed:think></seed:think>' }}{%- endif %}
{%- endif -%}
"""
)

# Granite 3.3: <|start_of_role|>ROLE<|end_of_role|>...<|end_of_text|>; a default system message
# dated by strftime_now (and a sentence more when thinking is on); the tools in an
# available_tools turn; calls <|tool_call|>[{...}] after the content; results in the
# tool_response role.
GRANITE: Final = r"""{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}{%- set rest = messages[1:] %}
{%- else %}
{%- set system = 'Knowledge Cutoff Date: April 2024.\nToday\'s Date: ' + strftime_now('%B %d, %Y') + '.\nYou are Granite, developed by IBM.' %}
{%- if tools %}{%- set system = system + ' You are a helpful assistant with access to the following tools. When a tool is required to answer the user\'s query, respond only with <|tool_call|> followed by a JSON list of tools used.' %}{%- endif %}
{%- if thinking is defined and thinking %}{%- set system = system + ' Think before you answer: write your thoughts between <think></think> and the answer between <response></response>.' %}{%- endif %}
{%- set rest = messages %}
{%- endif %}
{{- '<|start_of_role|>system<|end_of_role|>' + system + '<|end_of_text|>\n' }}
{%- if tools %}{{- '<|start_of_role|>available_tools<|end_of_role|>' + tools | tojson(indent=4) + '<|end_of_text|>\n' }}{%- endif %}
{%- for m in rest %}
{%- if m.role == 'assistant' %}
{{- '<|start_of_role|>assistant<|end_of_role|>' + (m.content or '') }}
{%- if m.tool_calls %}{{- '<|tool_call|>' + m.tool_calls | map(attribute='function') | list | tojson }}{%- endif %}
{{- '<|end_of_text|>\n' }}
{%- elif m.role == 'tool' %}{{- '<|start_of_role|>tool_response<|end_of_role|>' + m.content + '<|end_of_text|>\n' }}
{%- else %}{{- '<|start_of_role|>' + m.role + '<|end_of_role|>' + m.content + '<|end_of_text|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_of_role|>assistant<|end_of_role|>' }}{%- endif %}
"""

# Command R7B: <BOS_TOKEN>, turns <|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|> / <|USER_TOKEN|> /
# <|CHATBOT_TOKEN|> ending <|END_OF_TURN_TOKEN|>; a preamble with the tools as JSON lines; an
# assistant's reasoning in <|START_THINKING|> (its calls' plan), calls as a JSON list in
# <|START_ACTION|> numbered in order, results in <|START_TOOL_RESULT|> as a JSON list numbered
# in the same order (the k-th result answers the k-th call); the answer in <|START_RESPONSE|>.
COMMAND_R: Final = r"""{{- bos_token }}
{%- set system = messages[0].content if messages[0].role == 'system' else '' %}
{%- set rest = messages[1:] if messages[0].role == 'system' else messages %}
{{- '<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|># System Preamble\nYou are in contextual safety mode.\n\n# Default Preamble\nYou are Command, a model by Cohere.' }}
{%- if tools %}{{- '\n\n## Available Tools\n```json\n[' }}{%- for t in tools %}{{- '\n    ' + t.function | tojson + (',' if not loop.last else '') }}{%- endfor %}{{- '\n]\n```' }}{%- endif %}
{%- if system %}{{- '\n\n# Developer Preamble\n' + system }}{%- endif %}
{{- '<|END_OF_TURN_TOKEN|>' }}
{%- set ns = namespace(n=0, results=0) %}
{%- for m in rest %}
{%- if m.role == 'user' %}{{- '<|START_OF_TURN_TOKEN|><|USER_TOKEN|>' + m.content + '<|END_OF_TURN_TOKEN|>' }}
{%- elif m.role == 'system' %}{{- '<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>' + m.content + '<|END_OF_TURN_TOKEN|>' }}
{%- elif m.role == 'assistant' %}
{{- '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' }}
{%- if m.tool_calls %}
{{- '<|START_THINKING|>' + (m.reasoning_content or m.content or '') + '<|END_THINKING|><|START_ACTION|>[' }}
{%- for call in m.tool_calls %}
{{- '\n    {"tool_call_id": "' + ns.n | string + '", "tool_name": "' + call.function.name + '", "parameters": ' + call.function.arguments | tojson + '}' + (',' if not loop.last else '') }}
{%- set ns.n = ns.n + 1 %}
{%- endfor %}
{{- '\n]<|END_ACTION|>' }}
{%- else %}{{- '<|START_RESPONSE|>' + m.content + '<|END_RESPONSE|>' }}{%- endif %}
{{- '<|END_OF_TURN_TOKEN|>' }}
{%- elif m.role == 'tool' %}
{{- '<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|><|START_TOOL_RESULT|>[\n    {"tool_call_id": "' + ns.results | string + '", "results": {"0": ' + m.content | tojson + '}, "is_error": null}\n]<|END_TOOL_RESULT|><|END_OF_TURN_TOKEN|>' }}
{%- set ns.results = ns.results + 1 %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' }}{%- endif %}
"""
