// The chat page of `infeng serve` (docs/web.md). Plain script, no build step, no dependency.
// Everything the model or the user wrote reaches the DOM through textContent (renderMarkdown):
// never innerHTML. Conversations live in localStorage; the API key in sessionStorage (this tab).
'use strict';

const CONVERSATIONS_KEY = 'infeng.conversations';
const CURRENT_KEY = 'infeng.current';
const SETTINGS_KEY = 'infeng.settings';
const API_KEY_KEY = 'infeng.apiKey';          // sessionStorage only
const SETTING_IDS = ['system', 'temperature', 'top_p', 'max_tokens', 'seed', 'json_schema', 'tools', 'tool_choice'];
const STATUS_EVERY_MS = 2000;

const $ = (id) => document.getElementById(id);

const state = {
  conversations: [],        // [{id, title, created, messages: [{role, content, model, stats}]}]
  currentId: null,
  controller: null,         // AbortController of the answer being streamed
};

// ---- storage ------------------------------------------------------------------------------------
function loadConversations() {
  try {
    const saved = JSON.parse(localStorage.getItem(CONVERSATIONS_KEY) || '[]');
    state.conversations = Array.isArray(saved) ? saved : [];
  } catch (e) {
    state.conversations = [];
  }
  state.currentId = localStorage.getItem(CURRENT_KEY);
  if (!current()) newConversation();
}

function saveConversations() {
  localStorage.setItem(CONVERSATIONS_KEY, JSON.stringify(state.conversations));
  localStorage.setItem(CURRENT_KEY, state.currentId);
}

function current() {
  return state.conversations.find((c) => c.id === state.currentId) || null;
}

function newConversation() {
  const conversation = {id: `c${Date.now()}-${Math.random().toString(36).slice(2, 8)}`, title: 'New chat',
                        created: new Date().toISOString(), messages: []};
  state.conversations.unshift(conversation);
  state.currentId = conversation.id;
  saveConversations();
  return conversation;
}

function loadSettings() {
  let saved = {};
  try { saved = JSON.parse(localStorage.getItem(SETTINGS_KEY) || '{}'); } catch (e) { saved = {}; }
  for (const id of SETTING_IDS) {
    if (typeof saved[id] === 'string') $(id).value = saved[id];
    $(id).addEventListener('change', saveSettings);
  }
}

function saveSettings() {
  const settings = {};
  for (const id of SETTING_IDS) settings[id] = $(id).value;
  localStorage.setItem(SETTINGS_KEY, JSON.stringify(settings));
}

// ---- the API ------------------------------------------------------------------------------------
function askForKey() {
  return new Promise((resolve) => {
    const dialog = $('key-dialog');
    const form = $('key-form');
    const done = (event) => {
      event.preventDefault();
      const key = $('api-key').value.trim();
      if (!key) return;
      sessionStorage.setItem(API_KEY_KEY, key);
      form.removeEventListener('submit', done);
      dialog.close();
      resolve(key);
    };
    form.addEventListener('submit', done);
    if (!dialog.open) dialog.showModal();
    $('api-key').focus();
  });
}

// fetch on this origin with the key (asked for on a 401, then the request is sent again).
async function api(path, options = {}) {
  for (;;) {
    const headers = Object.assign({}, options.headers || {});
    const key = sessionStorage.getItem(API_KEY_KEY);
    if (key) headers.Authorization = `Bearer ${key}`;
    const response = await fetch(path, Object.assign({}, options, {headers}));
    if (response.status !== 401) return response;
    sessionStorage.removeItem(API_KEY_KEY);
    await askForKey();
  }
}

async function errorText(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch (e) {
    return `HTTP ${response.status}`;
  }
}

async function loadModels() {
  const response = await api('/v1/models');
  if (!response.ok) throw new Error(await errorText(response));
  const select = $('model');
  const chosen = select.value;
  select.replaceChildren();
  for (const entry of (await response.json()).data) {
    const option = document.createElement('option');
    option.value = entry.id;
    option.textContent = entry.parent ? `${entry.id} (adapter on ${entry.parent})` : entry.id;
    select.append(option);
  }
  if ([...select.options].some((o) => o.value === chosen)) select.value = chosen;
}

// ---- markdown as DOM (text nodes only) ---------------------------------------------------------
// Fenced code blocks (an unterminated fence while streaming), headings, bullet and numbered lists,
// paragraphs; inline `code`, **bold** and *emphasis*. Anything else stays literal text.
function renderMarkdown(text, container) {
  container.replaceChildren();
  const parts = text.split(/^```/m);
  parts.forEach((part, i) => {
    if (i % 2 === 1) {
      const newline = part.indexOf('\n');
      const language = newline < 0 ? part : part.slice(0, newline);
      const code = newline < 0 ? '' : part.slice(newline + 1);
      const pre = document.createElement('pre');
      const element = document.createElement('code');
      if (language.trim()) element.dataset.language = language.trim();
      element.textContent = code.replace(/\n$/, '');
      pre.append(element);
      container.append(pre);
    } else {
      renderBlocks(part, container);
    }
  });
}

function renderBlocks(text, container) {
  let list = null;
  let paragraph = null;
  for (const line of text.split('\n')) {
    const heading = /^(#{1,6})\s+(.*)$/.exec(line);
    const item = /^\s*(?:[-*+]|(\d+)[.)])\s+(.*)$/.exec(line);
    if (!line.trim()) {
      list = paragraph = null;
    } else if (heading) {
      const element = document.createElement(`h${Math.min(heading[1].length + 2, 6)}`);
      renderInline(heading[2], element);
      container.append(element);
      list = paragraph = null;
    } else if (item) {
      const kind = item[1] ? 'ol' : 'ul';
      if (!list || list.tagName.toLowerCase() !== kind) {
        list = document.createElement(kind);
        container.append(list);
      }
      const li = document.createElement('li');
      renderInline(item[2], li);
      list.append(li);
      paragraph = null;
    } else {
      if (!paragraph) {
        paragraph = document.createElement('p');
        container.append(paragraph);
      } else {
        paragraph.append('\n');
      }
      renderInline(line, paragraph);
      list = null;
    }
  }
}

function renderInline(text, element) {
  const pattern = /(`[^`]+`|\*\*[^*]+\*\*|\*[^*\s][^*]*\*)/g;
  let at = 0;
  for (const match of text.matchAll(pattern)) {
    element.append(text.slice(at, match.index));
    const token = match[0];
    const [tag, inner] = token.startsWith('`') ? ['code', token.slice(1, -1)]
      : token.startsWith('**') ? ['strong', token.slice(2, -2)] : ['em', token.slice(1, -1)];
    const child = document.createElement(tag);
    child.textContent = inner;
    element.append(child);
    at = match.index + token.length;
  }
  element.append(text.slice(at));
}

// ---- the conversation view ----------------------------------------------------------------------
function renderConversations() {
  const list = $('conversations');
  list.replaceChildren();
  for (const conversation of state.conversations) {
    const li = document.createElement('li');
    li.textContent = conversation.title;
    li.title = conversation.title;
    if (conversation.id === state.currentId) li.classList.add('current');
    li.addEventListener('click', () => {
      if (state.controller) return;
      state.currentId = conversation.id;
      saveConversations();
      renderAll();
    });
    list.append(li);
  }
}

function statsText(stats) {
  if (!stats) return '';
  const parts = [`${stats.tokens} tokens`];
  if (stats.ttft_ms != null) parts.push(`TTFT ${stats.ttft_ms.toFixed(0)} ms`);
  if (stats.tok_s != null) parts.push(`${stats.tok_s.toFixed(1)} tok/s`);
  if (stats.finish) parts.push(stats.finish);
  return parts.join(' · ');
}

function messageBody(message) {
  let text = message.content || '';
  for (const call of message.tool_calls || []) {
    text += `${text ? '\n\n' : ''}\`\`\`tool-call\n${call.function.name}(${call.function.arguments})\n\`\`\``;
  }
  return text;
}

function renderMessage(message, element) {
  element.className = `message ${message.role}${message.error ? ' error' : ''}`;
  element.replaceChildren();
  const role = document.createElement('div');
  role.className = 'role';
  role.textContent = message.role === 'assistant' && message.model ? `assistant · ${message.model}` : message.role;
  const body = document.createElement('div');
  body.className = 'body';
  if (message.error) body.textContent = message.error;
  else renderMarkdown(messageBody(message), body);
  element.append(role, body);
  if (message.stats) {
    const stats = document.createElement('div');
    stats.className = 'stats';
    stats.textContent = statsText(message.stats);
    element.append(stats);
  }
}

function renderMessages() {
  const container = $('messages');
  container.replaceChildren();
  for (const message of current().messages) {
    const element = document.createElement('div');
    renderMessage(message, element);
    container.append(element);
  }
  container.scrollTop = container.scrollHeight;
}

function renderAll() {
  $('title').value = current().title;
  renderConversations();
  renderMessages();
}

function showError(text) {
  $('error').hidden = !text;
  $('error').textContent = text || '';
}

// ---- a request ----------------------------------------------------------------------------------
function requestBody(conversation) {
  const messages = [];
  const system = $('system').value.trim();
  if (system) messages.push({role: 'system', content: system});
  for (const m of conversation.messages) {
    if (m.error) continue;
    messages.push({role: m.role, content: messageBody(m)});
  }
  const body = {model: $('model').value, messages, stream: true, stream_options: {include_usage: true},
                temperature: Number($('temperature').value), top_p: Number($('top_p').value),
                max_tokens: Number($('max_tokens').value)};
  if ($('seed').value.trim()) body.seed = Number($('seed').value);
  const schema = $('json_schema').value.trim();
  if (schema) {
    body.response_format = {type: 'json_schema', json_schema: {name: 'answer', schema: parseJSON(schema, 'JSON schema')}};
  }
  const tools = $('tools').value.trim();
  if (tools) {
    body.tools = parseJSON(tools, 'Tools');
    if (!Array.isArray(body.tools)) throw new Error('Tools: must be a JSON array of tool definitions');
    body.tool_choice = $('tool_choice').value;
  }
  return body;
}

function parseJSON(text, what) {
  try {
    return JSON.parse(text);
  } catch (e) {
    throw new Error(`${what}: not valid JSON (${e.message})`);
  }
}

// Server-sent events of one streamed answer: calls onData with each parsed `data:` payload.
async function readEvents(response, onData) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = '';
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, {stream: true});
    let end;
    while ((end = buffer.indexOf('\n\n')) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split('\n')) {
        if (!line.startsWith('data:')) continue;
        const data = line.slice(5).trim();
        if (data === '[DONE]') return;
        onData(JSON.parse(data));
      }
    }
  }
}

async function send(text) {
  const conversation = current();
  let body;
  conversation.messages.push({role: 'user', content: text});
  try {
    body = requestBody(conversation);
  } catch (e) {
    conversation.messages.pop();
    showError(e.message);
    return;
  }
  if (conversation.title === 'New chat') conversation.title = text.slice(0, 40);
  showError('');
  const answer = {role: 'assistant', content: '', model: body.model, stats: null};
  conversation.messages.push(answer);
  saveConversations();
  renderAll();
  const element = $('messages').lastElementChild;
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  const started = performance.now();
  let firstAt = null;
  let tokens = 0;
  let finish = null;
  let redraw = 0;
  const draw = () => {
    redraw = 0;
    renderMessage(answer, element);
    $('messages').scrollTop = $('messages').scrollHeight;
  };
  const stats = () => {
    const seconds = firstAt == null ? 0 : (performance.now() - firstAt) / 1000;
    return {tokens, ttft_ms: firstAt == null ? null : firstAt - started,
            tok_s: seconds > 0 && tokens > 1 ? (tokens - 1) / seconds : null, finish};
  };
  try {
    const response = await api('/v1/chat/completions', {
      method: 'POST', headers: {'Content-Type': 'application/json'}, body: JSON.stringify(body),
      signal: controller.signal});
    if (!response.ok) throw new Error(await errorText(response));
    await readEvents(response, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
      if (chunk.usage) tokens = chunk.usage.completion_tokens;
      for (const choice of chunk.choices || []) {
        const delta = choice.delta || {};
        if (delta.content) {
          if (firstAt == null) firstAt = performance.now();
          answer.content += delta.content;
          if (!chunk.usage) tokens += 1;
        }
        for (const call of delta.tool_calls || []) {
          if (firstAt == null) firstAt = performance.now();
          answer.tool_calls = answer.tool_calls || [];
          const entry = answer.tool_calls[call.index || 0] ||
            (answer.tool_calls[call.index || 0] = {id: call.id, type: 'function', function: {name: '', arguments: ''}});
          if (call.function && call.function.name) entry.function.name += call.function.name;
          if (call.function && call.function.arguments) entry.function.arguments += call.function.arguments;
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
      if (!redraw) redraw = requestAnimationFrame(draw);
    });
  } catch (e) {
    if (e.name === 'AbortError') finish = 'stopped';
    else if (answer.content) finish = `error: ${e.message}`;
    else answer.error = e.message;
  } finally {
    if (redraw) cancelAnimationFrame(redraw);
    answer.stats = answer.error ? null : stats();
    state.controller = null;
    setBusy(false);
    saveConversations();
    draw();
    refreshStatus();
  }
}

function setBusy(busy) {
  $('send').disabled = busy;
  $('stop').disabled = !busy;
  document.body.dataset.busy = busy ? 'true' : 'false';
}

// ---- status panel from /metrics -----------------------------------------------------------------
function metricValue(text, name) {
  const pattern = new RegExp(`^${name.replace(/[:]/g, '\\$&')}(?:\\{[^}]*\\})?\\s+(\\S+)`, 'm');
  const match = pattern.exec(text);
  return match ? Number(match[1]) : null;
}

async function refreshStatus() {
  try {
    const response = await fetch('/metrics');
    if (!response.ok) return;
    const text = await response.text();
    const show = (id, value, format) => { $(id).textContent = value == null ? '–' : format(value); };
    show('status-running', metricValue(text, 'vllm:num_requests_running'), (v) => String(v));
    show('status-waiting', metricValue(text, 'vllm:num_requests_waiting'), (v) => String(v));
    show('status-kv', metricValue(text, 'vllm:kv_cache_usage_perc'), (v) => `${(100 * v).toFixed(1)} %`);
    show('status-tps', metricValue(text, 'infeng_tokens_per_second'), (v) => v.toFixed(1));
  } catch (e) {
    // the server is gone or restarting: the panel keeps its last values
  }
}

// ---- wiring -------------------------------------------------------------------------------------
function exportConversation() {
  const conversation = current();
  const blob = new Blob([JSON.stringify(conversation, null, 2)], {type: 'application/json'});
  const link = document.createElement('a');
  link.href = URL.createObjectURL(blob);
  link.download = `${conversation.title.replace(/[^\w.-]+/g, '_') || 'chat'}.json`;
  link.click();
  setTimeout(() => URL.revokeObjectURL(link.href), 1000);
}

function wire() {
  $('composer').addEventListener('submit', (event) => {
    event.preventDefault();
    const text = $('prompt').value.trim();
    if (!text || state.controller) return;
    $('prompt').value = '';
    send(text);
  });
  $('prompt').addEventListener('keydown', (event) => {
    if (event.key === 'Enter' && !event.shiftKey) {
      event.preventDefault();
      $('composer').requestSubmit();
    }
  });
  $('stop').addEventListener('click', () => state.controller && state.controller.abort());
  $('new-chat').addEventListener('click', () => {
    if (state.controller) return;
    newConversation();
    renderAll();
  });
  $('title').addEventListener('change', () => {
    current().title = $('title').value.trim() || 'Untitled';
    saveConversations();
    renderConversations();
  });
  $('delete').addEventListener('click', () => {
    if (state.controller) return;
    state.conversations = state.conversations.filter((c) => c.id !== state.currentId);
    state.currentId = state.conversations.length ? state.conversations[0].id : null;
    if (!current()) newConversation();
    saveConversations();
    renderAll();
  });
  $('export').addEventListener('click', exportConversation);
}

async function start() {
  loadSettings();
  loadConversations();
  wire();
  renderAll();
  setBusy(false);
  refreshStatus();
  setInterval(refreshStatus, STATUS_EVERY_MS);
  try {
    await loadModels();
  } catch (e) {
    showError(`cannot list the models: ${e.message}`);
  }
  document.body.dataset.ready = 'true';
}

document.addEventListener('DOMContentLoaded', start);
