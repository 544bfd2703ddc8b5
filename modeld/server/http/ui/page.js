// modeld's live page: draws /ui/state, kept current over Server-Sent Events (/ui/events).
// Plain DOM, no framework, no build step. Every value is set as text (never as HTML).
'use strict';

const view = { state: null, selected: null, sortKey: 'last_used_at', sortDir: -1, filter: '' };

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === 'class') node.className = v;
    else if (k === 'text') node.textContent = v;
    else if (k === 'style') node.style.cssText = v;
    else if (k.startsWith('on')) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? '' : String(v));
  }
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function num(n) { return (n || 0).toLocaleString('en-US'); }
function bytes(n) {
  if (!n) return '0 B';
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0; let v = n;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return `${v.toFixed(v >= 100 || i === 0 ? 0 : 1)} ${units[i]}`;
}
function ago(t, now) {
  if (!t) return '-';
  const s = Math.max(0, now - t);
  if (s < 60) return `${s.toFixed(0)}s ago`;
  if (s < 3600) return `${(s / 60).toFixed(0)}m ago`;
  if (s < 86400) return `${(s / 3600).toFixed(1)}h ago`;
  return `${(s / 86400).toFixed(1)}d ago`;
}
function ms(v) { return v === null || v === undefined ? '-' : v >= 1000 ? `${(v / 1000).toFixed(2)} s` : `${v.toFixed(1)} ms`; }
function clock(t) { return t ? new Date(t * 1000).toLocaleTimeString('en-GB') : '-'; }
function reused(s) { return s.reused_kv + s.reused_ram + s.reused_disk + s.reused_shared; }

function bar(parts, total, title) {
  const b = el('div', { class: 'bar', title: title || '' });
  const sum = total || parts.reduce((a, p) => a + p.value, 0) || 1;
  for (const p of parts) {
    if (p.value <= 0) continue;
    b.append(el('span', { class: p.cls, style: `width:${(100 * p.value / sum).toFixed(3)}%`,
      title: `${p.label}: ${p.text || num(p.value)}`, 'data-part': p.part || p.cls, 'data-value': p.value }));
  }
  return b;
}

function grid(...pairs) {
  const box = el('div', { class: 'kvgrid' });
  for (let i = 0; i < pairs.length; i += 2) box.append(el('span', { class: 'muted', text: pairs[i] }), el('span', { text: pairs[i + 1] }));
  return box;
}

function fill(id, ...nodes) { const box = document.getElementById(id); box.replaceChildren(...nodes.flat()); return box; }

// --- models, tiers and memory ---------------------------------------------------------------

function renderModels(s) {
  if (!s.models.length) { fill('models-body', el('p', { class: 'muted', text: 'No model is loaded yet: it loads with its first turn.' })); return; }
  const cards = s.models.map((m) => {
    const w = m.worker;
    const ctx = Object.entries(m.contexts_in_kv);
    const convOf = {};
    for (const c of s.conversations) if (c.session) convOf[c.session] = c.key;
    const poolParts = ctx.map(([sid, tokens], i) => ({ cls: `p${i % 8}`, value: tokens, label: convOf[sid] || sid, text: `${num(tokens)} cells` }));
    const mem = m.memory;
    const memParts = [
      { cls: 'p0', value: mem.weights, label: 'weights', text: bytes(mem.weights) },
      { cls: 'p1', value: mem.kv_allocated, label: 'KV allocated', text: bytes(mem.kv_allocated) },
      { cls: 'p2', value: mem.compute, label: 'compute', text: bytes(mem.compute) },
      { cls: 'p3', value: mem.runtime, label: 'runtime', text: bytes(mem.runtime) },
    ];
    const c = m.counters;
    return el('div', { class: 'card', 'data-model': m.label },
      el('div', { class: 'title' }, `${m.label} `, el('span', { class: 'muted', text: `${m.backend} · window ${num(m.n_ctx)} · ${m.sequences} sequences` })),
      grid(
        'worker', w ? `${w.state} · ${w.isolation} · pid ${w.pid} · ${bytes(w.rss_bytes)} RSS · ${w.restarts} restarts` : 'in the daemon',
        'slots', `${m.busy_slots} of ${m.slots} busy · ${m.queued} queued · ${m.sessions} sessions`,
        'KV pool', `${num(m.resident_tokens)} of ${num(m.pool_tokens)} cells used (${num(m.busy_tokens)} by running turns) · ${num(m.free_tokens)} free`),
      bar([...poolParts, { cls: 'kept', value: m.shared_tokens, label: 'prefixes shared by several contexts (stored once)', text: `${num(m.shared_tokens)} cells` },
        { cls: 'free', value: m.free_tokens, label: 'free', text: `${num(m.free_tokens)} cells` }], m.pool_tokens, 'the KV pool: the cells each warm context holds, those they share, the free ones'),
      el('div', { class: 'muted', text: `memory: ${mem.isolation === 'process' ? `parts ${bytes(mem.weights + mem.kv_allocated + mem.compute + mem.runtime)} against ${bytes(mem.rss)} RSS` : 'inside the daemon'}` }),
      mem.isolation === 'process' ? bar(memParts, 0, 'weights, KV, compute buffer, runtime') : null,
      mem.isolation === 'process' ? el('div', { class: 'legend' }, memParts.map((p) => [el('span', { class: `sw ${p.cls}` }), ` ${p.label} ${p.text}`])) : null,
      el('div', { class: 'muted' }, `since loaded: ${num(c.queries)} prefix tokens looked up · reused ${num(c.reused_kv)} kv, ${num(c.reused_ram)} ram, ${num(c.reused_disk)} disk, ${num(c.reused_shared || 0)} shared · ${num(c.prefilled)} computed · evicted ${num((c.evicted_to_ram || 0) + (c.evicted_to_disk || 0) + (c.evicted_dropped || 0))}`));
  });
  fill('models-body', el('div', { class: 'cards' }, cards));
}

function renderTiers(s) {
  const t = s.tiers; const rows = [];
  for (const name of ['ram', 'disk', 'shared']) {
    const tier = t[name];
    if (!tier) continue;
    rows.push(el('div', { class: 'card', 'data-tier': name },
      el('div', { class: 'title' }, `${name === 'ram' ? 'RAM' : name} tier `, el('span', { class: 'muted', text: `${num(tier.entries)} snapshots · ${bytes(tier.bytes)} of ${tier.budget ? bytes(tier.budget) : 'off'}` })),
      bar([{ cls: name, value: tier.bytes, label: 'held', text: bytes(tier.bytes) }, { cls: 'free', value: Math.max(0, tier.budget - tier.bytes), label: 'free', text: bytes(Math.max(0, tier.budget - tier.bytes)) }], tier.budget || 1)));
  }
  const m = s.memory;
  rows.push(el('div', { class: 'card' }, el('div', { class: 'title', text: 'memory' }),
    grid("daemon's own", bytes(m.own), 'RAM tier', bytes(m.ram_tier),
      'parts (daemon and workers)', bytes(m.parts), 'measured RSS', bytes(m.measured), 'adds up', m.adds_up ? 'yes' : 'no (see modeld status)')));
  fill('tiers-body', el('div', { class: 'cards' }, rows));
}

// --- conversations ----------------------------------------------------------------------------

function sortValue(c, key) {
  if (key === 'reused') return reused(c.sums);
  if (key === 'prefilled') return c.sums.prefilled_tokens;
  if (key === 'generated') return c.sums.generated_tokens;
  return c[key];
}

function renderConversations(s) {
  const f = view.filter.toLowerCase();
  let rows = s.conversations.filter((c) => !f || [c.key, c.job, c.agent, c.model, c.tier, c.api].some((v) => (v || '').toLowerCase().includes(f)));
  rows = rows.slice().sort((a, b) => {
    const x = sortValue(a, view.sortKey); const y = sortValue(b, view.sortKey);
    return (x > y ? 1 : x < y ? -1 : 0) * view.sortDir;
  });
  if (view.selected === null && rows.length) view.selected = rows.find((c) => c.turns)?.key || null;
  document.querySelectorAll('#conv-table th').forEach((th) => {
    th.classList.toggle('sorted', th.dataset.sort === view.sortKey);
    th.classList.toggle('asc', view.sortDir > 0);
  });
  fill('conv-body', rows.map((c) => el('tr', { class: c.key === view.selected ? 'selected' : '', 'data-key': c.key, onclick: () => { view.selected = c.key; render(); } },
    el('td', { class: 'key', title: c.key, text: c.key }),
    el('td', { text: [c.job, c.agent].filter(Boolean).join(' · ') || c.api || '-' }),
    el('td', { text: c.model || '-' }),
    el('td', { text: c.tiers.join(', ') || '-' }),
    el('td', { class: 'num', text: num(c.tokens) }),
    el('td', { text: ago(c.last_used_at, s.now) }),
    el('td', { text: c.pinned ? 'pinned' : '' }),
    el('td', { class: 'num', text: c.running ? `${c.turns} (${c.running} running)` : num(c.turns) }),
    el('td', { class: 'num', 'data-field': 'reused', text: num(reused(c.sums)) }),
    el('td', { class: 'num', 'data-field': 'prefilled', text: num(c.sums.prefilled_tokens) }),
    el('td', { class: 'num', 'data-field': 'generated', text: num(c.sums.generated_tokens) }),
    el('td', { class: c.last_outcome, text: c.last_outcome ? `${c.last_outcome} (${c.last_reason})` : '-' }))));
  const more = s.conversations_total > s.conversations.length ? ` (the ${s.conversations.length} most recent of ${s.conversations_total})` : '';
  document.getElementById('conv-count').textContent = `${rows.length} shown${more}`;
}

// --- a conversation's turns -------------------------------------------------------------------

function turnWhy(r) {
  if (r.outcome === 'warm' || !r.outcome) return null;
  const where = [];
  if (r.diverged_at_token !== null && r.diverged_at_token !== undefined) where.push(`at token ${num(r.diverged_at_token)}`);
  if (r.diverged_message !== null && r.diverged_message !== undefined) where.push(`message ${r.diverged_message}`);
  if (r.diverged_segment) where.push(`segment '${r.diverged_segment}'`);
  return `${r.outcome}: ${r.reason}${where.length ? ` ${where.join(', ')}` : ''}${r.tier && r.reason === 'evicted' ? ` (went to ${r.tier})` : ''}`;
}

function turnRow(r, i, widest, ahead) {
  const restored = r.reused_ram + r.reused_disk + r.reused_shared;
  const kept = Math.max(0, r.prompt_tokens - r.reused_kv - restored - r.prefilled_tokens);
  const parts = [
    { cls: 'kv', part: 'reused_kv', value: r.reused_kv, label: 'reused from the KV' },
    { cls: 'ram', part: 'reused_ram', value: r.reused_ram, label: 'restored from RAM' },
    { cls: 'disk', part: 'reused_disk', value: r.reused_disk, label: 'restored from disk' },
    { cls: 'shared', part: 'reused_shared', value: r.reused_shared, label: 'restored from the shared store' },
    { cls: 'kept', part: 'kept', value: kept, label: 'suffix kept from the last turn' },
    { cls: 'prefilled', part: 'prefilled', value: r.prefilled_tokens, label: 'prefilled' },
    { cls: 'generated', part: 'generated', value: r.generated_tokens, label: 'generated' },
  ];
  const total = parts.reduce((a, p) => a + p.value, 0);
  const facts = [`TTFT ${ms(r.ttft_ms)}`];
  if (r.decode_tps) facts.push(`${r.decode_tps.toFixed(1)} tok/s`);
  if (r.drafted_tokens) facts.push(`speculation ${num(r.accepted_tokens)}/${num(r.drafted_tokens)} accepted`);
  if (r.restore_ms) facts.push(`restore ${ms(r.restore_ms)}`);
  facts.push(`${num(reused(r))} reused · ${num(r.prefilled_tokens)} prefilled · ${num(r.generated_tokens)} generated`);
  if (r.error) facts.push(`error ${r.error}`);
  if (ahead) facts.push(`then ${num(ahead.prefilled_tokens)} tokens computed ahead of the next turn${ahead.state === 'running' ? ' (running)' : ''}`);
  const why = turnWhy(r);
  return el('div', { class: 'turn', 'data-turn': r.id },
    el('div', { class: 'head' }, el('b', { text: `#${i + 1} ` }), el('span', { class: r.outcome || 'muted', text: r.outcome || r.state }), ` · ${clock(r.started_at)}`,
      el('div', { class: 'muted', text: `${r.api}${r.finish ? ` · ${r.finish}` : ''}${r.state === 'running' ? ` · ${r.stage}` : ''}` })),
    el('div', {},
      el('div', { style: `width:${Math.max(2, 100 * total / widest).toFixed(2)}%` }, bar(parts, total, `turn ${i + 1}`)),
      el('div', { class: 'facts', text: facts.join(' · ') }),
      why ? el('div', { class: 'why', 'data-why': r.reason, text: why }) : null,
      r.excerpt ? el('div', { class: 'excerpt', text: r.excerpt }) : null));
}

const fetched = { key: null, turns: -1, records: [], asked: null };

function turnsOf(s, key) {
  // The state carries the newest records; a conversation with more turns is fetched whole, once
  // per turn count (the running ones come from the state).
  const mine = s.records.filter((r) => (r.conversation || `${r.api}:${r.session}`) === key);
  const row = s.conversations.find((c) => c.key === key);
  const done = mine.filter((r) => r.state === 'done' && r.finish !== 'ahead').length;
  if (!row || done >= row.turns) return mine;
  if (fetched.key === key && fetched.turns === row.turns) {
    const known = new Set(fetched.records.map((r) => r.id));
    return [...fetched.records, ...mine.filter((r) => !known.has(r.id))];
  }
  const asked = `${key}|${row.turns}`;
  if (fetched.asked !== asked) {
    fetched.asked = asked;
    fetch(`/v1/requests?${new URLSearchParams({ conversation: key, limit: '1000' })}`, { credentials: 'same-origin' })
      .then((res) => (res.ok ? res.json() : null))
      .then((body) => { if (body) { Object.assign(fetched, { key, turns: row.turns, records: body.data }); render(); } });
  }
  return mine;
}

function renderTurns(s) {
  // A prefill ahead of the next turn (finish 'ahead') is no turn: it is told on the turn that left it.
  const records = (view.selected ? turnsOf(s, view.selected) : []).slice().sort((a, b) => a.started_at - b.started_at);
  const turns = [];
  const ahead = new Map();
  for (const r of records) {
    if (r.finish !== 'ahead') turns.push(r);
    else if (turns.length) ahead.set(turns[turns.length - 1].id, r);
  }
  document.getElementById('turns-of').textContent = view.selected ? `of ${view.selected}` : '';
  if (!turns.length) { fill('turns-body', el('p', { class: 'muted', text: 'Pick a conversation above.' })); return; }
  const widest = Math.max(1, ...turns.map((r) => r.prompt_tokens + r.generated_tokens, 0));
  fill('turns-body', turns.map((r, i) => turnRow(r, i, widest, ahead.get(r.id))));
}

// --- in flight, refusals, requests, fleet -----------------------------------------------------

function recordTable(records, now) {
  if (!records.length) return el('p', { class: 'muted', text: 'none' });
  return el('table', {}, el('thead', {}, el('tr', {}, ['id', 'started', 'api', 'job', 'conversation', 'model', 'state', 'finish', 'prompt', 'reused', 'generated', 'TTFT', 'bytes in/out'].map((h) => el('th', { text: h })))),
    el('tbody', {}, records.map((r) => el('tr', { 'data-record': r.id, onclick: () => { view.selected = r.conversation; render(); } },
      el('td', { class: 'key', text: r.id }), el('td', { text: `${clock(r.started_at)} (${ago(r.started_at, now)})` }), el('td', { text: r.api }),
      el('td', { text: r.job || '-' }), el('td', { class: 'key', title: r.conversation, text: r.conversation }), el('td', { text: r.model }),
      el('td', { text: r.state === 'running' ? r.stage : r.state }), el('td', { text: r.error ? `${r.finish} (${r.error})` : r.finish }),
      el('td', { class: 'num', text: num(r.prompt_tokens) }), el('td', { class: 'num', text: num(reused(r)) }),
      el('td', { class: 'num', text: num(r.generated_tokens) }), el('td', { class: 'num', text: ms(r.ttft_ms) }),
      el('td', { class: 'num', text: `${bytes(r.bytes_in)} / ${bytes(r.bytes_out)}` })))));
}

function renderInflight(s) {
  document.getElementById('queue').textContent = `${s.inflight.length} running · ${s.queued} waiting for a slot`;
  fill('inflight-body', s.inflight.length ? s.inflight.map((r) => el('div', { class: 'turn', 'data-running': r.id },
    el('div', { class: 'head' }, el('b', { text: r.conversation }), el('div', { class: 'muted', text: `${r.api} · ${r.job || r.agent || ''} · ${ago(r.started_at, s.now)}` })),
    el('div', {}, r.queue_position ? `waiting for a slot (#${r.queue_position} in the queue) ` : `${r.stage} `, r.progress_total ? el('span', { class: 'progress', title: `${num(r.progress_done)} of ${num(r.progress_total)} tokens` },
      el('span', { style: `width:${(100 * r.progress_done / r.progress_total).toFixed(1)}%` })) : null,
    r.progress_total ? ` ${num(r.progress_done)} / ${num(r.progress_total)} tokens` : ''))) : el('p', { class: 'muted', text: 'Nothing is running.' }));
  fill('refusals-body', recordTable(s.refusals, s.now));
}

function renderFleet(s) {
  const shared = s.tiers.shared;
  document.getElementById('fleet').hidden = !shared;
  document.getElementById('fleet-link').hidden = !shared;
  if (!shared) return;
  fill('fleet-body', grid('written to the store', num(shared.written), 'restored from it', num(shared.restored),
    'refused (corrupt, foreign)', num(shared.rejected), 'writes failed', num(shared.write_failed), 'looked up on a miss', num(shared.lookups),
    'on their way', num(shared.pending), 'held', `${num(shared.entries)} snapshots · ${bytes(shared.bytes)} of ${bytes(shared.budget)}`));
}

function render() {
  const s = view.state;
  if (!s) return;
  const d = s.daemon;
  document.getElementById('daemon').textContent = `${d.version} · instance ${d.instance} (epoch ${d.epoch}) · up ${ago(s.now - d.uptime_seconds, s.now).replace(' ago', '')} · ${d.sessions} sessions${d.owner_lost ? ` · ownership lost: ${d.owner_lost}` : ''}`;
  renderModels(s); renderTiers(s); renderConversations(s); renderTurns(s); renderInflight(s); renderFleet(s);
  const f = s.records_file;
  document.getElementById('footer').textContent = `${num(f.ring)} records in memory (of ${num(f.ring_limit)}) · ${num(f.files)} files, ${bytes(f.file_bytes)} · prompt text ${s.show_prompts ? 'shown where a prefix diverged (--ui-show-prompts)' : 'never shown'} · updated ${clock(s.now)}`;
}

async function search(ev) {
  ev.preventDefault();
  const params = new URLSearchParams({ limit: '200' });
  const job = document.getElementById('job').value.trim(); const since = document.getElementById('since').value.trim();
  if (job) params.set('job', job);
  if (since) params.set('since', since);
  const note = document.getElementById('search-note');
  const res = await fetch(`/v1/requests?${params}`, { credentials: 'same-origin' });
  const body = await res.json();
  if (!res.ok) { note.textContent = body.error ? body.error.message : `HTTP ${res.status}`; return; }
  note.textContent = `${body.data.length} found`;
  fill('requests-body', recordTable(body.data.slice().reverse(), Date.now() / 1000));
}

function connect() {
  const live = document.getElementById('live');
  const source = new EventSource('/ui/events');
  source.addEventListener('state', (e) => { view.state = JSON.parse(e.data); live.textContent = 'live'; live.className = 'pill on'; render(); });
  source.onerror = () => { live.textContent = 'reconnecting'; live.className = 'pill off'; };
}

document.addEventListener('DOMContentLoaded', () => {
  document.querySelectorAll('#conv-table th').forEach((th) => th.addEventListener('click', () => {
    if (view.sortKey === th.dataset.sort) view.sortDir = -view.sortDir; else { view.sortKey = th.dataset.sort; view.sortDir = -1; }
    render();
  }));
  document.getElementById('filter').addEventListener('input', (e) => { view.filter = e.target.value; render(); });
  document.getElementById('search').addEventListener('submit', search);
  connect();
});
