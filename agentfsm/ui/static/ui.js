// Shared by the pages: building elements from data (text only: every
// string the store holds is the model's or a tool's, untrusted, and goes
// into the page through textContent, never as markup), the API's address,
// and a live stream that says whether it is connected.
"use strict";

const agentfsm = (() => {
  const meta = (name) => {
    const tag = document.querySelector(`meta[name="${name}"]`);
    return tag ? tag.content : "";
  };
  const root = meta("agentfsm-root");

  // The characters a terminal or a page would act on or hide (controls,
  // bidirectional overrides, invisible marks, lone surrogates), written as
  // escapes: the same set and form as the library's `printable` (_text.py).
  const CONTROL = /[\u0000-\u0008\u000b-\u001f\u007f-\u009f\u061c\u200b\u200e\u200f\u2028-\u202e\u2060-\u2069\ufeff]|\p{Cs}/gu;
  function visible(text) {
    return String(text).replace(/\r\n/g, "\n").replace(CONTROL, (c) => {
      const code = c.charCodeAt(0);
      return code < 0x100 ? `\\x${code.toString(16).padStart(2, "0")}` : `\\u${code.toString(16).padStart(4, "0")}`;
    });
  }

  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(props || {})) {
      if (value === undefined || value === null) continue;
      if (key === "text") node.textContent = visible(value);
      else if (key === "class") node.className = value;
      else if (key === "title") node.title = String(value);
      else if (key === "href") node.href = value;
      else node.setAttribute(key, String(value));
    }
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : document.createTextNode(visible(child)));
    }
    return node;
  }

  function clear(node) {
    while (node.firstChild) node.removeChild(node.firstChild);
  }

  function api(path) {
    return `${root}/api/${path}`;
  }

  // A loop id as the end of an address: one percent-encoded segment, or
  // `?id=` for "." and "..", which every URL parser resolves away as dot
  // segments (even written %2E).
  function loopPath(id) {
    return id === "." || id === ".." ? `?id=${encodeURIComponent(id)}` : encodeURIComponent(id);
  }

  function age(fromIso, nowIso) {
    if (!fromIso) return "";
    const seconds = Math.max(0, (Date.parse(nowIso) - Date.parse(fromIso)) / 1000);
    if (seconds < 60) return `${seconds.toFixed(seconds < 10 ? 1 : 0)} s`;
    if (seconds < 3600) return `${Math.floor(seconds / 60)} min`;
    if (seconds < 86400) return `${(seconds / 3600).toFixed(1)} h`;
    return `${(seconds / 86400).toFixed(1)} d`;
  }

  function tokens(usage) {
    if (!usage) return "";
    const total = (usage.input_tokens || 0) + (usage.output_tokens || 0);
    const unreported = usage.unreported_requests ? ` (+${usage.unreported_requests} unreported)` : "";
    return `${total}${unreported}`;
  }

  // What went wrong, in #problem (none: hidden).
  function problem(text) {
    const box = document.getElementById("problem");
    if (!box) return;
    box.hidden = !text;
    box.textContent = text ? visible(text) : "";
  }

  // An EventSource that shows its state in #live; `on` maps event names to
  // handlers of the parsed data. The browser reconnects by itself, sending
  // the last event id, so the server resumes where the page left off. A
  // store that cannot be read is a `store-error` event (the stream goes on
  // and the page recovers with the store); an answer that is not a stream
  // (a 401 once the server has a new token, a 400) ends it, and the page
  // asks the same address as JSON for why.
  function live(path, on) {
    const badge = document.getElementById("live");
    const source = new EventSource(api(path));
    const show = (text, cls) => {
      if (!badge) return;
      badge.textContent = text;
      badge.className = `live ${cls}`;
    };
    source.onopen = () => show("live", "on");
    source.onerror = () => {
      if (source.readyState !== EventSource.CLOSED) {
        show("reconnecting", "off");
        return;
      }
      show("stopped", "off");
      fetch(api(path.replace(/^stream\//, "")), { cache: "no-store" })
        .then(async (answer) => {
          if (answer.status === 401) return "the access token is no longer valid: open the URL `agentfsm ui` printed";
          const data = await answer.json().catch(() => ({}));
          return `${data.error || "the stream was refused"} (${answer.status}): reload the page to try again`;
        })
        .catch(() => "the server cannot be reached: reload the page to try again")
        .then(problem);
    };
    source.addEventListener("store-error", (message) => {
      show("store error", "off");
      problem(`the store cannot be read: ${JSON.parse(message.data).error}`);
    });
    for (const [name, handle] of Object.entries(on)) {
      source.addEventListener(name, (message) => {
        show("live", "on");
        problem("");
        handle(JSON.parse(message.data));
        document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
      });
    }
    return source;
  }

  return { el, clear, api, age, tokens, live, root, meta, visible, loopPath, problem };
})();
