// constrained-serve web console: plain JavaScript over the service's own HTTP API (no build step, no
// external files). Text from the server (scenario names, token text, error messages) is only ever set as
// textContent, never parsed as HTML.
"use strict";

(function () {
  const TREE_LIMIT = 200; // allowed tokens listed in the tree view
  const PLAY_LIMIT = 50; // allowed tokens listed per playground step

  const state = {
    scenarios: [],
    selected: null, // scenario name
    history: [],
    prefix: [], // tree view: token ids walked so far
    texts: new Map(), // token id -> decoded text, from every answer seen
  };

  const $ = (id) => document.getElementById(id);

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === undefined || value === null || value === false) continue;
      if (key === "class") node.className = value;
      else if (key === "text") node.textContent = value;
      else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else if (key.startsWith("data-")) node.setAttribute(key, String(value));
      else node.setAttribute(key, value === true ? "" : String(value));
    }
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function show(target, text, kind) {
    const node = typeof target === "string" ? $(target) : target;
    node.textContent = text || "";
    node.className = "msg" + (text ? " " + (kind || "info") : "");
  }

  // ------------------------------------------------------------------------------------------ token

  // The admin token lives in this closure only: not in sessionStorage or localStorage, which every page of this
  // origin can read (/docs among them), nor in a cookie. A reload forgets it; type it again.
  let adminToken = "";

  function token() {
    return adminToken;
  }

  function setToken(value) {
    adminToken = value || "";
    renderTokenStatus();
  }

  function renderTokenStatus() {
    const status = $("token-status");
    if (token()) {
      status.textContent = "token set for this tab";
      status.className = "badge ok";
    } else {
      status.textContent = "no token: read-only";
      status.className = "badge warn";
    }
  }

  // ------------------------------------------------------------------------------------------ API

  class ApiError extends Error {
    constructor(status, message, body) {
      super(message);
      this.status = status;
      this.body = body;
    }
  }

  // fetch + JSON; admin calls carry the token when there is one (the server decides, the page never skips a
  // change because the token is missing: the refusal the user sees is the server's).
  async function api(method, path, body, admin) {
    const headers = { Accept: "application/json" };
    if (body !== undefined) headers["Content-Type"] = "application/json";
    if (admin && token()) headers.Authorization = "Bearer " + token();
    let response;
    try {
      response = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
    } catch (e) {
      throw new ApiError(0, "the service did not answer (" + e.message + ")");
    }
    let data = null;
    try {
      data = await response.json();
    } catch (e) {
      data = null;
    }
    if (!response.ok) {
      const message = data && data.error && data.error.message ? data.error.message : response.statusText;
      throw new ApiError(response.status, message, data);
    }
    return data;
  }

  function describeError(error, what) {
    if (!(error instanceof ApiError) || !error.status) return what + ": " + error.message;
    if (error.status === 401) return what + " refused (401): " + error.message + ". Enter the admin token above.";
    return what + " failed (" + error.status + "): " + error.message;
  }

  const enc = encodeURIComponent;

  // ------------------------------------------------------------------------------------------ tokens as chips

  function visible(text) {
    // whitespace made visible: a leading space is what most tokens start with
    return text.replace(/ /g, "\u2423").replace(/\n/g, "\u23ce").replace(/\t/g, "\u21e5").replace(/\r/g, "\u240d");
  }

  function remember(entries) {
    for (const item of entries || []) if (item) state.texts.set(item.id, item.text);
  }

  function chip(item, extra) {
    const text = item.text !== undefined ? item.text : state.texts.get(item.id);
    const label = text === undefined ? "" : visible(text);
    return el(
      extra && extra.onclick ? "button" : "span",
      {
        type: extra && extra.onclick ? "button" : undefined,
        class: "tok" + (extra && extra.class ? " " + extra.class : ""),
        "data-id": item.id,
        "data-text": text === undefined ? undefined : text,
        title: "id " + item.id + (text === undefined ? "" : " = " + JSON.stringify(text)),
        onclick: extra && extra.onclick,
      },
      text === undefined ? null : el("span", { class: "tok-text", text: label || "\u2205" }),
      el("span", { class: "tok-id", text: String(item.id) }),
    );
  }

  // ------------------------------------------------------------------------------------------ scenarios

  async function loadScenarios() {
    show("scenarios-msg", "");
    let data;
    try {
      data = await api("GET", "/v1/scenarios");
    } catch (error) {
      show("scenarios-msg", describeError(error, "Listing scenarios"), "error");
      return;
    }
    state.scenarios = data.scenarios || [];
    const body = $("scenario-table").tBodies[0];
    body.replaceChildren();
    for (const s of state.scenarios) {
      body.append(
        el(
          "tr",
          { "data-name": s.name, class: s.name === state.selected ? "selected" : undefined },
          el("td", {}, el("button", { type: "button", class: "link scenario-select", text: s.name, onclick: () => select(s.name) })),
          el("td", { text: s.type }),
          el("td", { class: "version", text: "v" + s.version }),
        ),
      );
    }
    if (!state.scenarios.length) show("scenarios-msg", "No scenarios stored yet (PUT /admin/scenarios/{name}).", "info");
  }

  function current() {
    return state.scenarios.find((s) => s.name === state.selected) || null;
  }

  async function select(name) {
    state.selected = name;
    for (const row of $("scenario-table").tBodies[0].rows) row.classList.toggle("selected", row.dataset.name === name);
    const s = current();
    $("selected-title").textContent = s ? s.name + " \u00b7 " + s.type + " \u00b7 v" + s.version : name;
    state.prefix = [];
    $("tree-version").value = "";
    $("play-result").hidden = true;
    show("play-msg", "");
    show("tree-msg", "");
    await Promise.all([loadHistory(), renderTree()]);
  }

  // ------------------------------------------------------------------------------------------ history and rollback

  async function loadHistory() {
    const name = state.selected;
    const body = $("history-table").tBodies[0];
    body.replaceChildren();
    $("history-body").hidden = true;
    if (!name) return;
    if (!token()) {
      show("history-msg", "The history is an admin route: enter the admin token above to see it.", "info");
      return;
    }
    let data;
    try {
      data = await api("GET", "/admin/scenarios/" + enc(name) + "/versions", undefined, true);
    } catch (error) {
      show("history-msg", describeError(error, "Loading the history"), "error");
      return;
    }
    if (name !== state.selected) return;
    show("history-msg", "");
    state.history = data.versions || [];
    const live = current();
    for (const v of state.history.slice().reverse()) {
      const isCurrent = live && live.version === v.version;
      const deleted = v.action === "delete";
      const action = v.action + (v.from_version ? " (from v" + v.from_version + ")" : "");
      body.append(
        el(
          "tr",
          { "data-version": v.version, class: isCurrent ? "current" : undefined },
          el("td", { class: "version", text: "v" + v.version + (isCurrent ? " (current)" : "") }),
          el("td", { text: action }),
          el("td", { text: v.type || "" }),
          el("td", { text: formatTime(v.created_at) }),
          el(
            "td",
            {},
            el(
              "div",
              { class: "actions" },
              deleted ? null : el("button", { type: "button", class: "secondary show-body", "data-version": v.version, text: "Body", onclick: () => showBody(v.version) }),
              deleted || isCurrent ? null : el("button", { type: "button", class: "danger rollback", "data-version": v.version, text: "Roll back to v" + v.version, onclick: () => rollback(v.version) }),
            ),
          ),
        ),
      );
    }
  }

  function formatTime(value) {
    if (value === null || value === undefined || value === "") return "";
    const seconds = Number(value); // epoch seconds, or an ISO date
    const date = Number.isFinite(seconds) ? new Date(seconds * 1000) : new Date(value);
    return Number.isNaN(date.getTime()) ? String(value) : date.toLocaleString();
  }

  async function showBody(version) {
    const pre = $("history-body");
    try {
      const record = await api("GET", "/admin/scenarios/" + enc(state.selected) + "?version=" + version, undefined, true);
      pre.textContent = "v" + version + ":\n" + JSON.stringify(record.scenario, null, 2);
      pre.hidden = false;
    } catch (error) {
      show("history-msg", describeError(error, "Reading version " + version), "error");
    }
  }

  async function rollback(version) {
    const name = state.selected;
    if (!name) {
      show("history-msg", "Pick a scenario first.", "error");
      return;
    }
    show("history-msg", "Rolling " + name + " back to version " + version + "\u2026", "info");
    let result;
    try {
      result = await api("POST", "/admin/scenarios/" + enc(name) + "/rollback", { version: Number(version) }, true);
    } catch (error) {
      show("history-msg", describeError(error, "Rollback"), "error");
      return;
    }
    await loadScenarios();
    await select(name);
    show("history-msg", "Rolled back: " + name + " is now version " + result.version + " (the body of version " + result.from_version + "); every replica serves it.", "ok");
  }

  // ------------------------------------------------------------------------------------------ inspect

  async function inspect(tokenIds, options) {
    const body = { token_ids: tokenIds, limit: options.limit, steps: options.steps };
    if (options.version) body.version = options.version;
    const data = await api("POST", "/admin/scenarios/" + enc(state.selected) + "/inspect", body, true);
    for (const step of data.steps) {
      remember(step.allowed);
      remember(step.banned);
      remember([step.token]);
    }
    return data;
  }

  function parseIds(text) {
    const parts = text.split(/[\s,]+/).filter(Boolean);
    const ids = parts.map(Number);
    const bad = parts.find((p, i) => !Number.isInteger(ids[i]) || ids[i] < 0);
    if (bad !== undefined) throw new Error("not a token id: " + JSON.stringify(bad));
    return ids;
  }

  // ------------------------------------------------------------------------------------------ tree view

  function renderPath() {
    const path = $("tree-path");
    path.replaceChildren(
      el("button", { type: "button", class: "crumb", text: "root", onclick: () => walkTo(0) }),
      ...state.prefix.map((id, i) => chip({ id }, { class: "crumb", onclick: () => walkTo(i + 1) })),
    );
    $("tree-prefix").value = state.prefix.join(", ");
  }

  function walkTo(length) {
    state.prefix = state.prefix.slice(0, length);
    renderTree();
  }

  async function renderTree() {
    renderPath();
    const allowedBox = $("tree-allowed");
    allowedBox.replaceChildren();
    $("tree-summary").textContent = "";
    $("tree-append-form").hidden = true;
    if (!state.selected) return;
    if (!token()) {
      show("tree-msg", "The allowed sets come from an admin route: enter the admin token above.", "info");
      return;
    }
    const version = Number($("tree-version").value) || null;
    const name = state.selected;
    const prefix = state.prefix.slice();
    let data;
    try {
      data = await inspect(prefix, { limit: TREE_LIMIT, steps: "last", version });
    } catch (error) {
      show("tree-msg", describeError(error, "Inspecting"), "error");
      return;
    }
    if (name !== state.selected || prefix.join() !== state.prefix.join()) return; // a newer walk started
    renderPath();
    const step = data.steps[data.steps.length - 1];
    if (data.error) {
      show("tree-msg", "This prefix is not reachable: " + data.error.message, "error");
      return;
    }
    show("tree-msg", "");
    const where = "v" + data.version + " \u00b7 step " + step.index + " \u00b7 " + step.phase;
    if (step.any) {
      const banned = step.banned.length ? " except " + step.banned.map((b) => JSON.stringify(b.text)).join(", ") : "";
      $("tree-summary").textContent = where + " \u00b7 any token (" + step.count + ")" + banned;
      $("tree-append-form").hidden = false;
      return;
    }
    const shown = step.allowed.length;
    $("tree-summary").textContent =
      where + " \u00b7 " + step.count + " allowed" + (step.truncated ? ", showing the first " + shown : "") +
      (data.finished ? " \u00b7 the row is finished" : "");
    allowedBox.dataset.count = step.count;
    for (const item of step.allowed) {
      const end = item.id === data.end_token_id;
      allowedBox.append(
        chip(item, {
          class: "next" + (end ? " end" : ""),
          onclick: data.finished ? undefined : () => {
            state.prefix.push(item.id);
            renderTree();
          },
        }),
      );
    }
  }

  // ------------------------------------------------------------------------------------------ playground

  async function runPlayground() {
    const name = state.selected;
    if (!name) {
      show("play-msg", "Pick a scenario first.", "error");
      return;
    }
    const request = { scenario: name, messages: [{ role: "user", content: $("play-prompt").value }] };
    for (const [id, key, parse] of [["play-max", "max_new_tokens", parseInt], ["play-temp", "temperature", parseFloat], ["play-seed", "seed", parseInt]]) {
      const raw = $(id).value.trim();
      if (raw !== "") request[key] = parse(raw, 10);
    }
    $("play-result").hidden = true;
    $("play-run").disabled = true;
    show("play-msg", "Generating\u2026", "info");
    let response;
    try {
      response = await api("POST", "/v1/generate", request);
    } catch (error) {
      show("play-msg", describeError(error, "Generation"), "error");
      return;
    } finally {
      $("play-run").disabled = false;
    }
    const output = response.outputs[0];
    $("play-output").textContent = output.text;
    $("play-meta").textContent =
      name + " v" + response.version + " \u00b7 " + output.token_ids.length + " tokens \u00b7 finish: " + output.finish_reason +
      (output.error ? " \u00b7 error: " + output.error : "");
    $("play-result").hidden = false;
    const rows = $("play-steps").tBodies[0];
    rows.replaceChildren();
    if (!token()) {
      show("play-msg", "Generated. Enter the admin token above to see the allowed set at each step.", "info");
      for (const [i, id] of output.token_ids.entries()) {
        rows.append(el("tr", { class: "step", "data-token-id": id }, el("td", { text: String(i) }), el("td"), el("td", {}, chip({ id })), el("td")));
      }
      return;
    }
    let data;
    try {
      data = await inspect(output.token_ids, { limit: PLAY_LIMIT, steps: "all", version: response.version });
    } catch (error) {
      show("play-msg", describeError(error, "Generated, but inspecting the steps"), "error");
      return;
    }
    show("play-msg", data.error ? "Step " + data.error.index + ": " + data.error.message : "", data.error ? "error" : "info");
    for (const step of data.steps) {
      if (!step.token) continue; // the step after the last token
      rows.append(playRow(step, data.end_token_id));
    }
  }

  function playRow(step, endId) {
    const chosen = step.token.id;
    const cells = el("div", { class: "tokens" });
    if (step.any) {
      const banned = step.banned.length ? " except " + step.banned.map((b) => JSON.stringify(b.text)).join(", ") : "";
      cells.append(el("span", { class: "any", text: "any token (" + step.count + ")" + banned }));
    } else {
      for (const item of step.allowed) {
        cells.append(chip(item, { class: (item.id === chosen ? "chosen" : "") + (item.id === endId ? " end" : "") }));
      }
      const listed = step.allowed.some((item) => item.id === chosen);
      if (step.truncated) cells.append(el("span", { class: "more", text: "\u2026 " + step.count + " allowed in all" + (listed ? "" : " (the chosen one is beyond those listed)") }));
    }
    return el(
      "tr",
      { class: "step" + (step.token_allowed ? "" : " invalid"), "data-token-id": chosen, "data-count": step.count, "data-any": step.any ? "1" : "0" },
      el("td", { text: String(step.index) }),
      el("td", { text: step.phase }),
      el("td", {}, chip(step.token, { class: "chosen" }), el("span", { class: step.token_allowed ? "ok-mark" : "bad-mark", text: step.token_allowed ? " \u2713" : " \u2717 not allowed" })),
      el("td", { class: "allowed" }, cells),
    );
  }

  // ------------------------------------------------------------------------------------------ wiring

  function switchTab(name) {
    for (const tab of document.querySelectorAll(".tab")) tab.classList.toggle("active", tab.dataset.tab === name);
    for (const panel of document.querySelectorAll(".panel")) panel.hidden = panel.dataset.panel !== name;
  }

  function init() {
    $("token-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const value = $("token-input").value.trim();
      $("token-input").value = "";
      setToken(value);
      if (state.selected) select(state.selected);
    });
    $("token-forget").addEventListener("click", () => {
      $("token-input").value = "";
      setToken("");
    });
    $("scenarios-refresh").addEventListener("click", loadScenarios);
    for (const tab of document.querySelectorAll(".tab")) tab.addEventListener("click", () => switchTab(tab.dataset.tab));
    $("rollback-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const version = Number($("rollback-version").value);
      if (!Number.isInteger(version) || version < 1) {
        show("history-msg", "Give a version number (1 or more).", "error");
        return;
      }
      rollback(version);
    });
    $("tree-form").addEventListener("submit", (event) => {
      event.preventDefault();
      try {
        state.prefix = parseIds($("tree-prefix").value);
      } catch (error) {
        show("tree-msg", error.message, "error");
        return;
      }
      renderTree();
    });
    $("tree-back").addEventListener("click", () => walkTo(Math.max(0, state.prefix.length - 1)));
    $("tree-reset").addEventListener("click", () => walkTo(0));
    $("tree-append-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const id = Number($("tree-append-id").value);
      if (!Number.isInteger(id) || id < 0) {
        show("tree-msg", "Give a token id (0 or more).", "error");
        return;
      }
      state.prefix.push(id);
      $("tree-append-id").value = "";
      renderTree();
    });
    $("play-form").addEventListener("submit", (event) => {
      event.preventDefault();
      runPlayground();
    });
    renderTokenStatus();
    for (const id of ["history-msg", "tree-msg", "play-msg"]) show(id, "Pick a scenario on the left.", "info");
    loadScenarios();
  }

  document.addEventListener("DOMContentLoaded", init);
})();
