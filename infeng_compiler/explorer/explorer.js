// The IR explorer (docs/web.md): every stage of a model's compile pipeline as a layered graph,
// the diff between consecutive stages, a node's details with its kernel's C source, and a profile
// heat overlay. Plain script, no dependency. Every IR string reaches the DOM through textContent.
'use strict';

const NODE_W = 168;
const NODE_H = 34;
const GAP_X = 18;
const GAP_Y = 26;
const COLLAPSE_ABOVE = 120;       // more nodes than this: layers start collapsed (but the first)
const SVG = 'http://www.w3.org/2000/svg';

const $ = (id) => document.getElementById(id);

const state = {
  data: null,
  stage: 0,
  collapsed: new Set(),   // layer numbers shown as one box
  selected: null,         // node id
  heat: false,
  view: {x: 0, y: 0, w: 1000, h: 800},
  bounds: {w: 1000, h: 800},
};

function el(tag, attrs = {}, text = null) {
  const element = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) element.setAttribute(k, v);
  if (text != null) element.textContent = text;
  return element;
}

function svg(tag, attrs = {}, text = null) {
  const element = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) element.setAttribute(k, v);
  if (text != null) element.textContent = text;
  return element;
}

async function loadData() {
  const inline = $('ir-data');
  if (inline) return JSON.parse(inline.textContent);
  const response = await fetch('data.json');
  if (!response.ok) throw new Error(`data.json: HTTP ${response.status}`);
  return response.json();
}

function currentStage() {
  return state.data.stages[state.stage];
}

function profileByNode() {
  const profile = state.data.profile;
  const byNode = new Map();
  if (profile) for (const row of profile.nodes) byNode.set(row.name, row);
  return byNode;
}

function truncate(text, n) {
  return text.length > n ? `${text.slice(0, n - 1)}…` : text;
}

// ---- timeline -----------------------------------------------------------------------------------
function diffCount(diff) {
  return diff ? diff.added.length + diff.removed.length + diff.changed.length : 0;
}

function renderTimeline() {
  const timeline = $('timeline');
  timeline.replaceChildren();
  state.data.stages.forEach((stage, i) => {
    if (i) timeline.append(el('span', {class: 'arrow'}, '→'));
    const button = el('button', {type: 'button', class: `stage${i === state.stage ? ' current' : ''}`,
                                 'data-stage': stage.name, title: stageTitle(stage)}, stage.name);
    if (stage.diff) button.append(el('span', {class: 'count'}, diffCount(stage.diff) ? `±${diffCount(stage.diff)}` : '='));
    button.addEventListener('click', () => selectStage(i));
    timeline.append(button);
  });
}

function stageTitle(stage) {
  const parts = [`${stage.nodes.length} nodes`];
  if (stage.seconds != null) parts.push(`${(stage.seconds * 1000).toFixed(1)} ms`);
  if (stage.tolerance != null) parts.push(`tolerance ${stage.tolerance}`);
  return parts.join(', ');
}

function selectStage(i) {
  state.stage = i;
  renderAll();
}

// ---- layout -------------------------------------------------------------------------------------
// Items are nodes, or a collapsed layer's nodes as one box. Each item's rank is one more than the
// highest rank among the items it reads from; items of a rank sit side by side.
function layout(stage) {
  const diff = stage.diff || {added: [], changed: []};
  const added = new Set(diff.added);
  const changed = new Set(diff.changed.map((c) => c.id));
  const items = new Map();
  const producer = new Map();
  const edges = new Set();
  for (const node of stage.nodes) {
    const key = node.layer != null && state.collapsed.has(node.layer) ? `layer:${node.layer}` : node.id;
    let item = items.get(key);
    if (!item) {
      item = key.startsWith('layer:')
        ? {key, group: node.layer, members: [], rank: 0}
        : {key, node, rank: 0};
      items.set(key, item);
    }
    if (item.members) item.members.push(node);
    item.added = item.added || added.has(node.id);
    item.changed = item.changed || changed.has(node.id);
    for (const input of node.inputs) {
      const from = producer.get(input);
      if (!from || from === item) continue;
      item.rank = Math.max(item.rank, from.rank + 1);
      edges.add(`${from.key}\u0000${key}`);
    }
    for (const out of node.outputs) producer.set(out.name, item);
  }
  const ranks = [];
  for (const item of items.values()) (ranks[item.rank] = ranks[item.rank] || []).push(item);
  const widest = Math.max(1, ...ranks.map((r) => (r ? r.length : 0)));
  const width = widest * (NODE_W + GAP_X);
  ranks.forEach((row, r) => {
    if (!row) return;
    const left = (width - row.length * (NODE_W + GAP_X)) / 2;
    row.forEach((item, c) => {
      item.x = left + c * (NODE_W + GAP_X);
      item.y = r * (NODE_H + GAP_Y);
    });
  });
  return {items, edges, width, height: ranks.length * (NODE_H + GAP_Y)};
}

// ---- drawing ------------------------------------------------------------------------------------
function heatColor(share, maxShare) {
  const t = maxShare > 0 ? Math.min(1, share / maxShare) : 0;
  return `hsl(${(1 - t) * 50}, 95%, ${97 - 45 * t}%)`;
}

function renderGraph() {
  const stage = currentStage();
  const {items, edges, width, height} = layout(stage);
  const heat = state.heat && state.stage === state.data.stages.length - 1 ? profileByNode() : null;
  const shareOf = (node) => (heat && heat.has(node.id) ? heat.get(node.id).pct_of_step : 0);
  let maxShare = 0;
  if (heat) {
    for (const item of items.values()) {
      item.share = item.node ? shareOf(item.node) : item.members.reduce((s, n) => s + shareOf(n), 0);
      maxShare = Math.max(maxShare, item.share);
    }
  }
  const edgeLayer = $('edges');
  const itemLayer = $('items');
  edgeLayer.replaceChildren();
  itemLayer.replaceChildren();
  for (const pair of edges) {
    const [a, b] = pair.split('\u0000').map((k) => items.get(k));
    const x1 = a.x + NODE_W / 2;
    const y1 = a.y + NODE_H;
    const x2 = b.x + NODE_W / 2;
    const y2 = b.y;
    const mid = (y1 + y2) / 2;
    edgeLayer.append(svg('path', {d: `M${x1},${y1} C${x1},${mid} ${x2},${mid} ${x2},${y2}`}));
  }
  for (const item of items.values()) {
    const classes = ['item'];
    if (item.members) classes.push('group');
    if (item.added) classes.push(item.members ? 'has-changes' : 'added');
    else if (item.changed) classes.push(item.members ? 'has-changes' : 'changed');
    if (item.node && item.node.id === state.selected) classes.push('selected');
    const g = svg('g', {class: classes.join(' '), transform: `translate(${item.x},${item.y})`});
    const rect = svg('rect', {width: NODE_W, height: NODE_H});
    if (heat) rect.style.fill = heatColor(item.share, maxShare);
    g.append(rect);
    if (item.members) {
      g.dataset.layer = String(item.group);
      g.append(svg('text', {x: 8, y: 14, class: 'op'}, `layer ${item.group}`));
      g.append(svg('text', {x: 8, y: 28}, `${item.members.length} nodes · click to expand`));
      g.addEventListener('click', () => { state.collapsed.delete(item.group); renderGraph(); });
    } else {
      g.dataset.id = item.node.id;
      g.append(svg('text', {x: 8, y: 14, class: 'op'}, truncate(item.node.op, 22)));
      g.append(svg('text', {x: 8, y: 28}, truncate(`%${item.node.id}`, 24)));
      g.append(svg('title', {}, item.node.text));
      g.addEventListener('click', (event) => {
        if (event.shiftKey && item.node.layer != null) {
          state.collapsed.add(item.node.layer);
          renderGraph();
          return;
        }
        selectNode(item.node.id);
      });
    }
    itemLayer.append(g);
  }
  state.bounds = {w: Math.max(width, NODE_W), h: Math.max(height, NODE_H)};
  applyView();
}

function fit() {
  // the whole width at most at natural size; a tall graph is panned (drag) or zoomed out (wheel)
  const pane = $('graph-pane');
  const aspect = pane.clientWidth / Math.max(1, pane.clientHeight);
  const viewW = Math.max(state.bounds.w + 40, pane.clientWidth);
  state.view = {x: -20 - (viewW - state.bounds.w - 40) / 2, y: -20, w: viewW, h: viewW / aspect};
  applyView();
}

function applyView() {
  const v = state.view;
  $('graph').setAttribute('viewBox', `${v.x} ${v.y} ${v.w} ${v.h}`);
}

function zoom(factor, cx = 0.5, cy = 0.5) {
  const v = state.view;
  const w = v.w * factor;
  const h = v.h * factor;
  state.view = {x: v.x + (v.w - w) * cx, y: v.y + (v.h - h) * cy, w, h};
  applyView();
}

function wirePanZoom() {
  const pane = $('graph-pane');
  pane.addEventListener('wheel', (event) => {
    event.preventDefault();
    const box = pane.getBoundingClientRect();
    zoom(event.deltaY > 0 ? 1.15 : 1 / 1.15, (event.clientX - box.left) / box.width, (event.clientY - box.top) / box.height);
  }, {passive: false});
  let drag = null;
  pane.addEventListener('pointerdown', (event) => {
    drag = {x: event.clientX, y: event.clientY, view: Object.assign({}, state.view)};
  });
  window.addEventListener('pointerup', () => { drag = null; });
  pane.addEventListener('pointermove', (event) => {
    if (!drag || !event.buttons) return;
    const scale = state.view.w / pane.clientWidth;
    state.view = Object.assign({}, drag.view, {x: drag.view.x - (event.clientX - drag.x) * scale,
                                              y: drag.view.y - (event.clientY - drag.y) * scale});
    applyView();
  });
  $('zoom-in').addEventListener('click', () => zoom(1 / 1.3));
  $('zoom-out').addEventListener('click', () => zoom(1.3));
  $('fit').addEventListener('click', fit);
}

// ---- side panels --------------------------------------------------------------------------------
function renderStageInfo() {
  const stage = currentStage();
  const section = $('stage-info');
  section.replaceChildren(el('h2', {}, `Stage ${state.stage}: ${stage.name}`));
  const facts = [`${stage.nodes.length} nodes`];
  if (stage.args && stage.args.length) facts.push(`args ${stage.args.join(', ')}`);
  if (stage.seconds != null) facts.push(`ran in ${(stage.seconds * 1000).toFixed(2)} ms`);
  if (stage.tolerance != null) facts.push(`declared tolerance ${stage.tolerance}`);
  section.append(el('p', {}, facts.join(' · ')));
  if (stage.note) section.append(el('p', {}, stage.note));
  const profile = state.data.profile;
  if (profile && state.heat && state.stage === state.data.stages.length - 1) {
    section.append(el('p', {id: 'heat-legend'},
      `profile: ${profile.artifact || ''} · step ${Number(profile.step_ms).toFixed(3)} ms · ` +
      `bandwidth ${profile.bandwidth_gb_s == null ? '?' : Number(profile.bandwidth_gb_s).toFixed(1)} GB/s · ` +
      'red = most of the step'));
  }
}

function renderDiff() {
  const stage = currentStage();
  const section = $('diff');
  section.replaceChildren();
  if (!stage.diff) {
    section.append(el('h2', {}, 'Diff'), el('p', {class: 'hint'}, 'The first stage: the graph as imported.'));
    return;
  }
  const previous = state.data.stages[state.stage - 1].name;
  const {added, removed, changed} = stage.diff;
  section.append(el('h2', {}, `Diff ${previous} → ${stage.name}`),
                 el('p', {id: 'diff-summary'}, `${added.length} added, ${removed.length} removed, ${changed.length} changed`));
  const list = el('ul', {class: 'diff-list'});
  const byId = new Map(stage.nodes.map((n) => [n.id, n]));
  for (const id of added) {
    const li = el('li', {class: 'added'}, `+ ${byId.get(id).text}`);
    li.addEventListener('click', () => selectNode(id));
    list.append(li);
  }
  for (const entry of removed) list.append(el('li', {class: 'removed'}, `− ${entry.text}`));
  for (const entry of changed) {
    const li = el('li', {class: 'changed'}, `~ ${entry.before}\n→ ${entry.after}`);
    li.style.whiteSpace = 'pre-wrap';
    li.addEventListener('click', () => selectNode(entry.id));
    list.append(li);
  }
  section.append(list);
}

function formatBytes(n) {
  return n >= 1 << 20 ? `${(n / (1 << 20)).toFixed(2)} MiB` : n >= 1024 ? `${(n / 1024).toFixed(1)} KiB` : `${n} B`;
}

function table(headers, rows) {
  const t = el('table');
  const head = el('tr');
  for (const h of headers) head.append(el('th', {}, h));
  t.append(head);
  for (const row of rows) {
    const tr = el('tr');
    for (const cell of row) tr.append(el('td', {}, cell == null ? '' : String(cell)));
    t.append(tr);
  }
  return t;
}

function selectNode(id) {
  state.selected = id;
  const node = currentStage().nodes.find((n) => n.id === id);
  const section = $('node');
  section.replaceChildren();
  if (!node) return;
  if (node.layer != null && state.collapsed.has(node.layer)) state.collapsed.delete(node.layer);
  renderGraph();
  section.append(el('h2', {}, `Node %${node.id}`), el('p', {}, `op ${node.op}` +
                 (node.layer != null ? ` · layer ${node.layer}` : '')), el('pre', {id: 'node-ir'}, node.text));
  section.append(el('h2', {}, 'Outputs'),
                 table(['value', 'dtype', 'shape'], node.outputs.map((o) => [`%${o.name}`, o.dtype, `[${o.shape.join(', ')}]`])));
  if (node.weights.length) {
    section.append(el('h2', {}, 'Weights'),
                   table(['weight', 'storage', 'type', 'bytes'],
                         node.weights.map((w) => [`@${w.name}`, w.format, w.type, formatBytes(w.bytes)])));
    const stats = node.weights.filter((w) => w.stats);
    if (stats.length) {
      const f = (x) => Number(x).toPrecision(4);
      section.append(el('h2', {}, 'Weight statistics (as stored)'),
                     table(['weight', 'min', 'max', 'mean', 'std', 'zeros'],
                           stats.map((w) => [`@${w.name}`, f(w.stats.min), f(w.stats.max), f(w.stats.mean),
                                             f(w.stats.std), `${(100 * w.stats.zeros).toFixed(1)} %`])));
    }
  }
  if (Object.keys(node.attrs).length) {
    section.append(el('h2', {}, 'Attributes'), el('pre', {}, JSON.stringify(node.attrs, null, 1)));
  }
  const timing = profileByNode().get(node.id);
  if (timing && state.stage === state.data.stages.length - 1) {
    section.append(el('h2', {}, 'Profile (decode step)'),
                   table(['ms per step', '% of step', 'GB/s', 'roofline fraction', 'calls'],
                         [[timing.ms, timing.pct_of_step, timing.gb_s, timing.roofline_frac, timing.calls]]));
  }
  if (node.kernels) {
    section.append(el('h2', {}, `Kernel calls (${node.kernels.length})`));
    if (!node.kernels.length) section.append(el('p', {class: 'hint'}, 'none: the node costs nothing at run time'));
    const shown = new Set();
    for (const call of node.kernels) {
      const guard = call.guard ? `if (${call.guard}) ` : '';
      if (!call.symbol) {
        section.append(el('pre', {}, `${guard}${call.code}`));
        continue;
      }
      section.append(el('pre', {class: 'call'}, `${guard}${call.symbol}(${call.args.join(', ')})`));
      if (shown.has(call.symbol)) continue;
      shown.add(call.symbol);
      const details = el('details', {open: ''});
      details.append(el('summary', {}, `${call.symbol}.c (${call.isa})`),
                     el('pre', {class: 'source'}, state.data.sources[call.symbol] || '(source not kept)'));
      section.append(details);
    }
  } else {
    section.append(el('p', {class: 'hint'}, 'Kernel calls and C source: see the lower stage.'));
  }
}

function centerOn(id) {
  const g = document.querySelector(`#items g.item[data-id="${CSS.escape(id)}"]`);
  if (!g) return;
  const match = /translate\(([-\d.]+),([-\d.]+)\)/.exec(g.getAttribute('transform'));
  const v = state.view;
  state.view = Object.assign({}, v, {x: Number(match[1]) + NODE_W / 2 - v.w / 2, y: Number(match[2]) + NODE_H / 2 - v.h / 2});
  applyView();
}

function find() {
  const wanted = $('find').value.trim().replace(/^%/, '');
  const nodes = currentStage().nodes;
  const node = nodes.find((n) => n.id === wanted) || nodes.find((n) => n.outputs.some((o) => o.name === wanted)) ||
    nodes.find((n) => n.text.includes(wanted));
  $('find').classList.toggle('missing', !node);
  if (!node) return;
  selectNode(node.id);
  centerOn(node.id);
}

function renderAll() {
  renderTimeline();
  renderStageInfo();
  renderDiff();
  renderGraph();
  if (state.selected) selectNode(state.selected);
}

function layers() {
  return new Set(currentStage().nodes.filter((n) => n.layer != null).map((n) => n.layer));
}

async function start() {
  try {
    state.data = await loadData();
  } catch (e) {
    $('error').hidden = false;
    $('error').textContent = `cannot load the IR data: ${e.message}`;
    return;
  }
  const data = state.data;
  $('model-name').textContent = `${data.model} · ${data.target}`;
  document.title = `${data.model}: IR explorer`;
  state.stage = data.stages.length - 1;
  const all = [...layers()].sort((a, b) => a - b);
  if (currentStage().nodes.length > COLLAPSE_ABOVE) for (const layer of all.slice(1)) state.collapsed.add(layer);
  if (data.profile) $('heat-toggle').hidden = false;
  $('heat').addEventListener('change', () => {
    state.heat = $('heat').checked;
    if (state.heat) state.stage = data.stages.length - 1;
    renderAll();
  });
  $('expand-all').addEventListener('click', () => { state.collapsed.clear(); renderGraph(); });
  $('collapse-all').addEventListener('click', () => { for (const l of layers()) state.collapsed.add(l); renderGraph(); });
  $('find').addEventListener('change', find);
  wirePanZoom();
  renderAll();
  fit();
  document.body.dataset.ready = 'true';
}

document.addEventListener('DOMContentLoaded', start);
