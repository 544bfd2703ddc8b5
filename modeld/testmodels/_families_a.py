"""Chat templates of the Qwen, gpt-oss, Llama 3 and Mistral families, written here.

Each reproduces its family's rules as the real template (llama.cpp's ``models/templates/``)
states them: the special tokens, the message fields it reads, what it renders otherwise once
more turns follow, what it refuses, and its tool-call and reasoning markup. The text is this
project's own; where a rule is kept, the comment before the template says which.
"""

from __future__ import annotations

from typing import Final

__all__ = ["GPT_OSS", "LLAMA33", "MISTRAL_SMALL", "QWEN3", "QWEN3_CODER", "QWEN35"]

# Qwen3 (Hermes JSON calls): tools in the system turn as JSON lines; an assistant turn after the
# last real user query shows its reasoning in <think> (the last one always, even empty), earlier
# ones do not (so a turn's <think> block is dropped once the next user turn follows); tool
# results are grouped into one user turn of <tool_response> blocks; enable_thinking=false
# closes an empty think block in the generation prompt. Arguments: text as given, else tojson.
QWEN3: Final = r"""{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- "# Tools\n\nYou may call functions to help with the request. Their signatures, in <tools></tools>:\n<tools>" }}
{%- for tool in tools %}{{- '\n' + tool | tojson }}{%- endfor %}
{{- "\n</tools>\n\nFor each call, answer with a JSON object in <tool_call></tool_call> tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(query=messages|length - 1, looking=true) %}
{%- for m in messages[::-1] %}
{%- if ns.looking and m.role == 'user' and not (m.content.startswith('<tool_response>') and m.content.endswith('</tool_response>')) %}
{%- set ns.looking = false %}{%- set ns.query = messages|length - 1 - loop.index0 %}
{%- endif %}
{%- endfor %}
{%- for m in messages %}
{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
{%- elif m.role == 'assistant' %}
{%- set content = m.content or '' %}{%- set thought = '' %}
{%- if m.reasoning_content is string %}{%- set thought = m.reasoning_content %}
{%- elif '</think>' in content %}
{%- set thought = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\n') %}
{%- endif %}
{%- if loop.index0 > ns.query and (loop.last or thought) %}
{{- '<|im_start|>assistant\n<think>\n' + thought.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
{%- else %}{{- '<|im_start|>assistant\n' + content }}{%- endif %}
{%- for call in m.tool_calls or [] %}
{%- if content or not loop.first %}{{- '\n' }}{%- endif %}
{%- set f = call.function if call.function is defined else call %}
{{- '<tool_call>\n{"name": "' + f.name + '", "arguments": ' }}
{{- f.arguments if f.arguments is string else f.arguments | tojson }}{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif m.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + m.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}
"""

# Qwen3-Coder (XML calls): tools as <function> blocks with their parameters (extra schema keys
# kept as tags); a call is <tool_call><function=NAME><parameter=KEY>VALUE</parameter>, the
# values raw text (objects and lists as JSON): the arguments must be objects (``|items``); tool
# results close their user turn only before a non-tool message or at the end; no reasoning.
QWEN3_CODER: Final = r"""{%- macro extra(d, known) %}
{%- if d is mapping %}{%- for k in d if k not in known %}
{{- '\n<' ~ k ~ '>' ~ (d[k] | tojson if d[k] is mapping or (d[k] is sequence and d[k] is not string) else d[k] | string) ~ '</' ~ k ~ '>' }}
{%- endfor %}{%- endif %}
{%- endmacro %}
{%- set rest = messages[1:] if messages[0].role == 'system' else messages %}
{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\n' + messages[0].content }}
{%- elif tools %}{{- '<|im_start|>system\nYou are Qwen, an assistant that works with a computer to solve tasks.' }}{%- endif %}
{%- if tools %}
{{- '\n\n# Tools\n\nYou can use these tools:\n\n<tools>' }}
{%- for t in tools %}{%- set t = t.function if t.function is defined else t %}
{{- '\n<function>\n<name>' ~ t.name ~ '</name>' }}
{%- if t.description is defined %}{{- '\n<description>' ~ (t.description | trim) ~ '</description>' }}{%- endif %}
{{- '\n<parameters>' }}
{%- for pname, p in (t.parameters.properties if t.parameters is mapping and t.parameters.properties is mapping else {}) | items %}
{{- '\n<parameter>\n<name>' ~ pname ~ '</name>' }}
{%- if p.type is defined %}{{- '\n<type>' ~ (p.type | string) ~ '</type>' }}{%- endif %}
{%- if p.description is defined %}{{- '\n<description>' ~ (p.description | trim) ~ '</description>' }}{%- endif %}
{{- extra(p, ['name', 'type', 'description']) }}{{- '\n</parameter>' }}
{%- endfor %}
{{- extra(t.parameters, ['type', 'properties']) }}{{- '\n</parameters>' }}{{- extra(t, ['type', 'name', 'description', 'parameters']) }}{{- '\n</function>' }}
{%- endfor %}
{{- '\n</tools>\n\nTo call a tool, reply ONLY in this format:\n\n<tool_call>\n<function=example_function>\n<parameter=example_parameter>\nvalue\n</parameter>\n</function>\n</tool_call>' }}
{%- endif %}
{%- if messages[0].role == 'system' or tools %}{{- '<|im_end|>\n' }}{%- endif %}
{%- for m in rest %}
{%- if m.role == 'assistant' and m.tool_calls %}
{{- '<|im_start|>assistant' }}
{%- if m.content is string and m.content | trim %}{{- '\n' + m.content | trim + '\n' }}{%- endif %}
{%- for call in m.tool_calls %}{%- set f = call.function if call.function is defined else call %}
{{- '\n<tool_call>\n<function=' + f.name + '>\n' }}
{%- for k, v in f.arguments | items %}
{{- '<parameter=' + k + '>\n' + (v | tojson if v is mapping or (v is sequence and v is not string) else v | string) + '\n</parameter>\n' }}
{%- endfor %}
{{- '</function>\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif m.role == 'tool' %}
{%- if loop.previtem and loop.previtem.role != 'tool' %}{{- '<|im_start|>user\n' }}{%- endif %}
{{- '<tool_response>\n' + m.content + '\n</tool_response>\n' }}
{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- else %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

# Qwen3.5 (XML calls, thinking): content may be a list of parts; no user query at all is
# refused ("No user query found in messages."), a system message past the first too; tools
# come before the system text; turns after the last user query keep their <think> block; the
# generation prompt opens <think> (closes it empty when enable_thinking is false).
QWEN35: Final = r"""{%- macro text(c) %}
{%- if c is string %}{{- c }}
{%- elif c is iterable and c is not mapping %}{%- for p in c %}
{%- if 'text' in p %}{{- p.text }}{%- else %}{{- raise_exception('Unexpected item type in content.') }}{%- endif %}
{%- endfor %}
{%- elif c is none or c is undefined %}{{- '' }}
{%- else %}{{- raise_exception('Unexpected content type.') }}{%- endif %}
{%- endmacro %}
{%- if not messages %}{{- raise_exception('No messages provided.') }}{%- endif %}
{%- if tools %}
{{- '<|im_start|>system\n# Tools\n\nYou can call these functions:\n\n<tools>' }}
{%- for t in tools %}{{- '\n' + t | tojson }}{%- endfor %}
{{- '\n</tools>\n\nTo call a function reply ONLY as:\n\n<tool_call>\n<function=example_function>\n<parameter=example_parameter>\nvalue\n</parameter>\n</function>\n</tool_call>' }}
{%- if messages[0].role == 'system' %}{%- set s = text(messages[0].content) | trim %}{%- if s %}{{- '\n\n' + s }}{%- endif %}{%- endif %}
{{- '<|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\n' + text(messages[0].content) | trim + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step=true, query=messages|length - 1) %}
{%- for m in messages[::-1] %}
{%- if ns.multi_step and m.role == 'user' %}{%- set c = text(m.content) | trim %}
{%- if not (c.startswith('<tool_response>') and c.endswith('</tool_response>')) %}
{%- set ns.multi_step = false %}{%- set ns.query = messages|length - 1 - loop.index0 %}
{%- endif %}{%- endif %}
{%- endfor %}
{%- if ns.multi_step %}{{- raise_exception('No user query found in messages.') }}{%- endif %}
{%- for m in messages %}
{%- set content = text(m.content) | trim %}
{%- if m.role == 'system' %}{%- if not loop.first %}{{- raise_exception('System message must be at the beginning.') }}{%- endif %}
{%- elif m.role == 'user' %}{{- '<|im_start|>user\n' + content + '<|im_end|>\n' }}
{%- elif m.role == 'assistant' %}
{%- set thought = '' %}
{%- if m.reasoning_content is string %}{%- set thought = m.reasoning_content %}
{%- elif '</think>' in content %}
{%- set thought = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\n') %}
{%- endif %}
{%- if loop.index0 > ns.query %}{{- '<|im_start|>assistant\n<think>\n' + thought | trim + '\n</think>\n\n' + content }}
{%- else %}{{- '<|im_start|>assistant\n' + content }}{%- endif %}
{%- for call in m.tool_calls or [] %}{%- set f = call.function if call.function is defined else call %}
{%- if not loop.first %}{{- '\n' }}{%- elif content | trim %}{{- '\n\n' }}{%- endif %}
{{- '<tool_call>\n<function=' + f.name + '>\n' }}
{%- for k, v in f.arguments | items %}
{{- '<parameter=' + k + '>\n' + (v | tojson if v is mapping or (v is sequence and v is not string) else v | string) + '\n</parameter>\n' }}
{%- endfor %}
{{- '</function>\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif m.role == 'tool' %}
{%- if loop.previtem and loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- else %}{{- raise_exception('Unexpected message role.') }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- else %}{{- '<think>\n' }}{%- endif %}
{%- endif %}
"""

# gpt-oss (harmony): a system message with today's date (strftime_now) and the reasoning
# effort (medium unless given); the caller's system or developer message and the tools (as a
# TypeScript namespace) in a developer message; an assistant's reasoning is its ``thinking``
# field, shown in the analysis channel only on a call not followed by a final answer; a call is
# ``to=functions.NAME<|channel|>commentary json<|message|>ARGS<|call|>`` (arguments tojson); a
# tool result names the last call's function (refused without one) and is tojson'd; the last
# assistant turn ends with <|return|> when no generation prompt follows, earlier ones <|end|>.
GPT_OSS: Final = r"""{%- macro ts(schema) %}
{%- if schema.properties is defined %}{{- '{\n' }}{%- for k, v in schema.properties | items %}
{%- if v.description is defined %}{{- '// ' + v.description + '\n' }}{%- endif %}
{{- k + ('' if k in (schema.required or []) else '?') + ': ' + (v.type if v.type is string else 'any') + ',\n' }}
{%- endfor %}{{- '}' }}{%- else %}{{- 'any' }}{%- endif %}
{%- endmacro %}
{{- '<|start|>system<|message|>' }}
{{- (model_identity if model_identity is defined else 'You are ChatGPT, a large language model trained by OpenAI.') + '\n' }}
{{- 'Knowledge cutoff: 2024-06\nCurrent date: ' + strftime_now('%Y-%m-%d') + '\n\n' }}
{{- 'Reasoning: ' + (reasoning_effort if reasoning_effort is defined else 'medium') + '\n\n' }}
{{- '# Valid channels: analysis, commentary, final. Channel must be included for every message.' }}
{%- if tools %}{{- "\nCalls to these tools must go to the commentary channel: 'functions'." }}{%- endif %}
{{- '<|end|>' }}
{%- set developer = messages[0].content if messages[0].role in ['system', 'developer'] else '' %}
{%- set rest = messages[1:] if messages[0].role in ['system', 'developer'] else messages %}
{%- if developer or tools %}
{{- '<|start|>developer<|message|>' }}
{%- if developer %}{{- '# Instructions\n\n' + developer + '\n\n' }}{%- endif %}
{%- if tools %}{{- '# Tools\n\n## functions\n\nnamespace functions {\n\n' }}
{%- for t in tools %}{%- set f = t.function if t.function is defined else t %}
{{- '// ' + (f.description or '') + '\ntype ' + f.name + ' = (_: ' + ts(f.parameters or {}) + ') => any;\n\n' }}
{%- endfor %}{{- '} // namespace functions' }}{%- endif %}
{{- '<|end|>' }}
{%- endif %}
{%- set last = namespace(name=none) %}
{%- for m in rest %}
{%- if m.role == 'assistant' %}
{%- if m.content and '<|channel|>' in m.content %}{{- raise_exception('Pass the analysis text in the thinking field, not <|channel|> tags in content.') }}{%- endif %}
{%- if m.tool_calls %}
{%- set later = namespace(final=false) %}
{%- for n in rest[loop.index:] %}{%- if n.role == 'assistant' and not n.tool_calls %}{%- set later.final = true %}{%- endif %}{%- endfor %}
{%- set f = m.tool_calls[0].function if m.tool_calls[0].function is defined else m.tool_calls[0] %}
{%- if m.content and m.thinking %}{{- raise_exception('Cannot pass both content and thinking in an assistant message with tool calls!') }}{%- endif %}
{%- if (m.content or m.thinking) and not later.final %}{{- '<|start|>assistant<|channel|>analysis<|message|>' + (m.content or m.thinking) + '<|end|>' }}{%- endif %}
{{- '<|start|>assistant to=functions.' + f.name + '<|channel|>commentary json<|message|>' + f.arguments | tojson + '<|call|>' }}
{%- set last.name = f.name %}
{%- elif loop.last and not add_generation_prompt %}
{%- if m.thinking %}{{- '<|start|>assistant<|channel|>analysis<|message|>' + m.thinking + '<|end|>' }}{%- endif %}
{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|return|>' }}
{%- else %}{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' }}{%- set last.name = none %}
{%- endif %}
{%- elif m.role == 'tool' %}
{%- if last.name is none %}{{- raise_exception('Message has tool role, but there was no previous assistant message with a tool call!') }}{%- endif %}
{{- '<|start|>functions.' + last.name + ' to=assistant<|channel|>commentary<|message|>' + m.content | tojson + '<|end|>' }}
{%- elif m.role == 'user' %}{{- '<|start|>user<|message|>' + m.content + '<|end|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}
"""

# Llama 3.3: BOS, header ids, "Today Date" (date_string, else a fixed date); with tools the
# first user message carries them (refused when there is none: "Cannot put tools in the first
# user message when there's no first user message!"); one call per message (refused
# otherwise) written as {"name": ..., "parameters": ...}; tool results in the ipython role
# (a string is iterable, so it is tojson'd); contents are trimmed.
LLAMA33: Final = r"""{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = '26 Jul 2024' %}{%- endif %}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if messages[0].role == 'system' %}{%- set system = messages[0].content | trim %}{%- set messages = messages[1:] %}{%- else %}{%- set system = '' %}{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}
{%- if tools is not none %}{{- 'Environment: ipython\n' }}{%- endif %}
{{- 'Cutting Knowledge Date: December 2023\nToday Date: ' + date_string + '\n\n' + system + '<|eot_id|>' }}
{%- if tools is not none %}
{%- if messages | length == 0 %}{{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}{%- endif %}
{{- '<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, respond with a JSON function call that best answers the prompt.\n\n' }}
{{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. Do not use variables.\n\n' }}
{%- for t in tools %}{{- t | tojson(indent=4) + '\n\n' }}{%- endfor %}
{{- messages[0].content | trim + '<|eot_id|>' }}{%- set messages = messages[1:] %}
{%- endif %}
{%- for m in messages %}
{%- if m.role in ['tool', 'ipython'] %}
{{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + (m.content | tojson if m.content is mapping or m.content is iterable else m.content) + '<|eot_id|>' }}
{%- elif m.tool_calls %}
{%- if m.tool_calls | length != 1 %}{{- raise_exception('This model only supports single tool-calls at once!') }}{%- endif %}
{%- set f = m.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "' + f.name + '", "parameters": ' + f.arguments | tojson + '}<|eot_id|>' }}
{%- else %}{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\n\n' + m.content | trim + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}
"""

# Mistral Small 3.2: BOS, a default system prompt dated by strftime_now; after the optional
# system message roles must alternate user/assistant (calls and results aside: refused
# otherwise); the tools go in [AVAILABLE_TOOLS] just before the LAST user message (so they move
# once a later user turn exists); calls are [TOOL_CALLS]NAME[CALL_ID]ID[ARGS]JSON with ids of 9
# alphanumerics (refused otherwise); results [TOOL_RESULTS]ID[TOOL_CONTENT]...; an assistant
# turn ends with EOS.
MISTRAL_SMALL: Final = r"""{%- set today = strftime_now('%Y-%m-%d') %}
{{- bos_token }}
{%- set system = 'You are Mistral Small 3, a language model by Mistral AI. Today is ' + today + '.' %}
{%- set rest = messages %}
{%- if messages and messages[0].role == 'system' %}
{%- set system = messages[0].content if messages[0].content is string else messages[0].content[0].text %}{%- set rest = messages[1:] %}
{%- endif %}
{%- set users = rest | selectattr('role', 'equalto', 'user') | list %}
{%- set ns = namespace(i=0) %}
{%- for m in rest %}{%- if not (m.role == 'tool' or m.get('tool_calls')) %}
{%- if (m.role == 'user') != (ns.i % 2 == 0) %}{{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}
{%- set ns.i = ns.i + 1 %}{%- endif %}{%- endfor %}
{{- '[SYSTEM_PROMPT]' + system + '[/SYSTEM_PROMPT]' }}
{%- for m in rest %}
{%- if m.role == 'system' %}{{- '[SYSTEM_PROMPT]' + m.content + '[/SYSTEM_PROMPT]' }}
{%- elif m.role == 'user' %}
{%- if tools and m == users[-1] %}{{- '[AVAILABLE_TOOLS]' + tools | tojson + '[/AVAILABLE_TOOLS]' }}{%- endif %}
{{- '[INST]' }}{%- if m.content is string %}{{- m.content }}{%- else %}{%- for b in m.content %}{{- b.text if b.type == 'text' else '[IMG]' }}{%- endfor %}{%- endif %}{{- '[/INST]' }}
{%- elif m.role == 'assistant' %}
{%- if m.get('tool_calls') %}
{%- for call in m.tool_calls %}
{%- if call.id is not string or call.id | length != 9 %}{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}
{{- '[TOOL_CALLS]' + call.function.name + '[CALL_ID]' + call.id + '[ARGS]' + call.function.arguments | tojson }}
{%- endfor %}{{- eos_token }}
{%- else %}{{- m.content + eos_token }}{%- endif %}
{%- elif m.role == 'tool' %}
{%- if m.tool_call_id is not string or m.tool_call_id | length != 9 %}{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}
{{- '[TOOL_RESULTS]' + m.tool_call_id + '[TOOL_CONTENT]' + m.content | string + '[/TOOL_RESULTS]' }}
{%- else %}{{- raise_exception('Only system, user, assistant, and tool roles are supported!') }}
{%- endif %}
{%- endfor %}
"""
