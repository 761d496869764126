// One loop's page: its summary, its path drawn over the machine, its
// timeline, ledger, decisions, requests and context, kept current by the
// stream (each `loop` event carries what the page lacks: the rows past the
// last seq it has, the context items past the ones it has, and the rest
// whole); and the forms that act on it (each a request the server checks,
// builds the decision of and stores for the runtime holding the loop).
"use strict";

(() => {
  const { el, clear, age, tokens, live, meta, visible, loopPath, api } = agentfsm;
  // Percent-encoded by the server: an attribute would not keep a NUL or a CR.
  const loopId = decodeURIComponent(meta("agentfsm-loop"));
  document.getElementById("loop-id").textContent = visible(loopId);
  document.title = `agentfsm · ${visible(loopId)}`;
  const SVG = "http://www.w3.org/2000/svg";
  let rowsSeen = 0;
  let itemsSeen = 0;

  function svg(tag, attrs, text) {
    const node = document.createElementNS(SVG, tag);
    for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, String(value));
    if (text !== undefined) node.textContent = visible(text);
    return node;
  }

  // The machine in rows (the server's layout: `path_graph`), drawn as SVG.
  // An edge down the rows is a straight line, its ends spread along the
  // nodes' borders; an edge back up leaves and enters by the outer side and
  // bends around; the untaken error edges meet at one junction above the end.
  function drawGraph(graph, box = document.getElementById("diagram"), note = document.getElementById("diagram-note")) {
    clear(box);
    const W = 160, H = 40, GAP_X = 90, GAP_Y = 74, PAD = 170;
    const widest = Math.max(...graph.rows.map((row) => row.length));
    const width = PAD * 2 + widest * W + (widest - 1) * GAP_X;
    const where = {};
    graph.rows.forEach((row, r) => {
      const rowWidth = row.length * W + (row.length - 1) * GAP_X;
      const left = (width - rowWidth) / 2;
      row.forEach((state, i) => {
        where[state] = { x: left + i * (W + GAP_X), y: 20 + r * (H + GAP_Y), row: r };
      });
    });
    const height = 40 + graph.rows.length * H + (graph.rows.length - 1) * GAP_Y;
    box.setAttribute("viewBox", `0 0 ${width} ${height}`);
    const defs = svg("defs", {});
    for (const kind of ["plain", "taken", "rewritten", "pending"]) {
      const marker = svg("marker", { id: `arrow-${kind}`, viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse" });
      marker.append(svg("path", { d: "M 0 0 L 10 5 L 0 10 z", class: `arrow ${kind}` }));
      defs.append(marker);
    }
    box.append(defs);
    const edges = svg("g", { class: "edges" });
    const line = (d, cls, marker, edge) => {
      const attrs = { d, class: cls };
      if (marker) attrs["marker-end"] = `url(#arrow-${marker})`;
      if (edge) Object.assign(attrs, { "data-source": edge.source, "data-dest": edge.dest });
      edges.append(svg("path", attrs));
    };
    const label = (x, y, text, kind, anchor) => edges.append(svg("text", { x, y, class: `label ${kind}`, "text-anchor": anchor || "start" }, text));
    const down = graph.edges.filter((e) => where[e.dest].row > where[e.source].row);
    const back = graph.edges.filter((e) => where[e.dest].row <= where[e.source].row);
    // Each node's outgoing and incoming down edges, spread along its border.
    const outs = {}, ins = {};
    for (const e of down) {
      (outs[e.source] = outs[e.source] || []).push(e);
      (ins[e.dest] = ins[e.dest] || []).push(e);
    }
    for (const e of down) {
      const a = where[e.source], b = where[e.dest];
      const sorter = (list, other) => [...list].sort((p, q) => where[p[other]].x - where[q[other]].x);
      const os = sorter(outs[e.source], "dest"), is = sorter(ins[e.dest], "source");
      const x1 = a.x + ((os.indexOf(e) + 1) * W) / (os.length + 1), y1 = a.y + H;
      const x2 = b.x + ((is.indexOf(e) + 1) * W) / (is.length + 1), y2 = b.y;
      line(`M ${x1} ${y1} L ${x2} ${y2}`, `edge ${e.kind}`, e.kind, e);
      const t = 0.3;
      label(x1 + (x2 - x1) * t + 4, y1 + (y2 - y1) * t + 4, e.label, e.kind);
    }
    const centre = width / 2;
    const byDepth = {};
    for (const e of back) {
      const a = where[e.source], b = where[e.dest];
      const left = a.x + W / 2 < centre || (a.x + W / 2 === centre && b.x + W / 2 <= centre);
      const side = left ? -1 : 1;
      const key = `${e.source}:${side}`;
      const nth = (byDepth[key] = (byDepth[key] || 0) + 1) - 1;
      const x1 = left ? a.x : a.x + W, y1 = a.y + H / 2 + (nth - 1) * 8;
      const x2 = left ? b.x : b.x + W, y2 = b.y + H / 2 + nth * 6;
      const out = Math.min(Math.min(x1, x2), centre) - 40 - nth * 34;
      const outR = Math.max(Math.max(x1, x2), centre) + 40 + nth * 34;
      const cx = left ? out : outR;
      line(`M ${x1} ${y1} C ${cx} ${y1} ${cx} ${y2} ${x2} ${y2}`, `edge ${e.kind}`, e.kind, e);
      label(cx + side * 4, (y1 + y2) / 2, e.label, e.kind, left ? "end" : "start");
    }
    const sources = graph.ended.sources;
    if (sources.length) {
      const end = where.idle_end;
      const jx = end.x + W / 2, jy = end.y - GAP_Y / 2;
      for (const s of sources) {
        const a = where[s];
        line(`M ${a.x + W / 2} ${a.y + H} L ${jx} ${jy}`, "edge ended", null, null);
      }
      edges.append(svg("circle", { cx: jx, cy: jy, r: 3, class: "junction" }));
      line(`M ${jx} ${jy} L ${jx} ${end.y}`, "edge plain", "plain", null);
      label(jx + 6, jy + 16, graph.ended.label, "plain");
    }
    box.append(edges);
    const nodes = svg("g", { class: "nodes" });
    for (const [state, spot] of Object.entries(where)) {
      const css = graph.nodes[state] || "";
      const group = svg("g", { class: `node ${css}`, "data-state": state });
      group.append(svg("rect", { x: spot.x, y: spot.y, width: W, height: H, rx: 10 }));
      const name = state === "idle_end" ? "idle" : state;
      group.append(svg("text", { x: spot.x + W / 2, y: spot.y + H / 2 + 5, "text-anchor": "middle" }, name));
      nodes.append(group);
    }
    box.append(nodes);
    if (note) note.textContent = visible(graph.note || graph.title);
  }

  function drawSummary(data) {
    const s = data.summary;
    const box = document.getElementById("summary");
    clear(box);
    const fact = (name, value, cls) => el("div", { class: `fact ${cls || ""}` }, el("span", { class: "name", text: name }), el("span", { class: "value", text: value }));
    box.append(
      fact("agent", s.agent_id),
      fact("status", s.status, `status ${s.status}`),
      fact("state", s.state, "state"),
      fact("outcome", s.outcome || "—", "outcome"),
      fact("turns", s.model_requests),
      fact("tool calls", s.tool_calls),
      fact("tokens", tokens(s.usage)),
      fact("age", age(s.started_at, data.now)),
      fact("owner", s.owner ? `${s.owner} (${s.lease_live ? "lease live" : "no live lease"})` : "—", "owner"),
    );
    document.body.dataset.status = s.status;
    document.body.dataset.state = s.state;
    const pause = document.getElementById("pause");
    pause.hidden = s.status !== "paused";
    document.getElementById("pause-reason").textContent = data.pause
      ? visible(`before ${data.pause.source} --${data.pause.trigger}--> ${data.pause.dest}: ${data.pause.reason}`)
      : "";
    document.getElementById("answer-box").hidden = data.answer === null;
    document.getElementById("answer").textContent = visible(data.answer || "");
    document.getElementById("error-box").hidden = data.error === null;
    document.getElementById("error").textContent = data.error ? visible(`${data.error.type}: ${data.error.message}`) : "";
  }

  // An image as a text view shows it: the library's `ImageBlock.reference`.
  function reference(image) {
    if (image.url) return `[image: ${image.url.length <= 80 ? image.url : `${image.url.slice(0, 77)}...`}]`;
    return `[image: ${image.media_type}, ${Number(image.size || 0).toLocaleString("en-US")} bytes, ${String(image.digest).slice(0, 19)}]`;
  }

  function imageUrl(digest) {
    const tail = `images/${encodeURIComponent(digest)}`;
    const where = loopId === "." || loopId === ".." ? `/${tail}?id=${encodeURIComponent(loopId)}` : `${encodeURIComponent(loopId)}/${tail}`;
    return api(`loops/${where}`);
  }

  // The images held as bytes, as thumbnails linking to the image whole (the
  // server sends them by digest, the data read carries references only); an
  // image by URL is shown by its reference alone: the page loads nothing
  // from elsewhere.
  function thumbs(images) {
    const box = el("div", { class: "thumbs" });
    for (const image of images || []) {
      if (!image || image.type !== "image" || image.url || !image.digest) continue;
      const src = imageUrl(image.digest);
      const said = visible(reference(image));
      box.append(el("a", { href: src, target: "_blank", rel: "noopener", class: "thumb" }, el("img", { src, loading: "lazy", alt: said, title: said })));
    }
    return box.childNodes.length ? box : null;
  }

  function addRows(data) {
    document.getElementById("no-events").hidden = data.events_kept;
    const body = document.querySelector("#timeline tbody");
    for (const row of data.rows) {
      if (row.seq <= rowsSeen) continue;
      const details = el("details", {}, el("summary", { text: "event" }), el("pre", { text: JSON.stringify(row.event, null, 2) }));
      body.append(
        el("tr", { class: `row ${row.kind}`, "data-seq": row.seq },
          el("td", { class: "num", text: row.seq }),
          el("td", { class: "num", text: `${row.elapsed.toFixed(3)} s` }),
          el("td", { class: "text" }, row.text, thumbs(row.images)),
          el("td", {}, details),
        ),
      );
      rowsSeen = Math.max(rowsSeen, row.seq);
    }
  }

  function drawLedger(calls) {
    const body = document.querySelector("#ledger tbody");
    clear(body);
    for (const c of calls) {
      const output = c.output ? outputText(c.output) : "";
      body.append(
        el("tr", { class: `call ${c.status}`, "data-call": c.call_id },
          el("td", { text: c.call_id }),
          el("td", { text: c.tool }),
          el("td", { class: "status", text: c.status }),
          el("td", { class: "num", text: c.attempt }),
          el("td", { class: "num", text: `#${c.request}.${c.position}` }),
          el("td", { class: "key", text: c.key }),
          el("td", { class: "output" }, el("pre", { text: output }), thumbs(c.output && c.output.images)),
          el("td", { text: c.by || "" }),
        ),
      );
    }
    document.getElementById("no-calls").hidden = calls.length > 0;
  }

  function drawDecisions(decisions) {
    const body = document.querySelector("#decisions tbody");
    clear(body);
    for (const d of decisions) {
      const kind = d.decision && d.decision.kind ? d.decision.kind : JSON.stringify(d.decision);
      body.append(
        el("tr", { class: "decision" },
          el("td", { class: "num", text: d.seq }),
          el("td", { text: `${d.source} --${d.trigger}--> ${d.dest}` }),
          el("td", {}, el("details", {}, el("summary", { text: kind }), el("pre", { text: JSON.stringify(d.decision, null, 2) }))),
          el("td", { text: d.by || (d.handler ? `handler ${d.handler}` : "") }),
          el("td", { text: d.at }),
        ),
      );
    }
    document.getElementById("no-decisions").hidden = decisions.length > 0;
  }

  // A tool's output as text: its text, then each of its images' reference.
  function outputText(output) {
    const text = `${output.is_error ? "error: " : ""}${output.output}`;
    return [text, ...(output.images || []).map(reference)].filter(Boolean).join(" ");
  }

  function itemText(item) {
    switch (item.type) {
      case "function_call": return `${item.name}(${item.arguments})  [${item.call_id}]`;
      case "function_call_output": return `${outputText(item)}  [${item.call_id}]`;
      default:
        // A user's message may be blocks: its text, its images by reference.
        if (Array.isArray(item.content)) return item.content.map((b) => (b.type === "image" ? reference(b) : b.text)).join(" ");
        return item.content || "";
    }
  }

  function itemImages(item) {
    if (item.type === "function_call_output") return item.images;
    return Array.isArray(item.content) ? item.content.filter((b) => b.type === "image") : [];
  }

  function addItems(data) {
    const list = document.getElementById("items");
    if (data.items_from < itemsSeen) {
      // The context shrank or was edited: the page redraws it whole.
      clear(list);
      itemsSeen = 0;
    }
    data.items.forEach((item, i) => {
      const index = data.items_from + i;
      if (index < itemsSeen) return;
      list.append(el("li", { class: `item ${item.type}`, value: index }, el("span", { class: "kind", text: item.type }), el("pre", { text: itemText(item) }), thumbs(itemImages(item))));
      itemsSeen = index + 1;
    });
  }

  // ------------------------------------------------------------ acting

  const formToken = meta("agentfsm-form");
  let formsFor = null; // the pause the forms were drawn for: kept while it lasts
  let resumeSeq = null;
  let callChoices = []; // one reader of its row's choice per call of the batch

  function requestsUrl(id) {
    const where = id === "." || id === ".." ? `/requests?id=${encodeURIComponent(id)}` : `${encodeURIComponent(id)}/requests`;
    return api(`loops/${where}`);
  }

  function say(text, cls) {
    const box = document.getElementById("action-status");
    box.textContent = visible(text);
    box.className = `action-status ${cls || ""}`;
  }

  async function send(body) {
    const buttons = document.querySelectorAll("#actions button");
    buttons.forEach((b) => { b.disabled = true; });
    say("sending…", "busy");
    try {
      const answer = await fetch(requestsUrl(loopId), {
        method: "POST",
        headers: { "content-type": "application/json", "x-agentfsm-form": formToken },
        body: JSON.stringify(body),
        cache: "no-store",
      });
      const data = await answer.json().catch(() => ({}));
      if (answer.status === 202) {
        say(`request #${data.id} stored, pending: the runtime holding the loop applies it`, "ok");
      } else {
        say(`refused (${answer.status}): ${data.error || "no reason given"}`, "bad");
      }
    } catch (error) {
      say(`the server cannot be reached: ${error}`, "bad");
    } finally {
      buttons.forEach((b) => { b.disabled = false; });
    }
  }

  // What a call of the batch may become: an uncertain call's outcome is
  // settled (it ran, or it did not); another call is approved, denied or
  // run with other arguments.
  function choicesOf(call) {
    if (call.uncertain) {
      return [["answer", "it ran: record this output"], ["approve", "it did not: run it"], ["deny", "deny"]];
    }
    return [["approve", "approve"], ["deny", "deny"], ["edit", "edit arguments"]];
  }

  function prettyArguments(text) {
    try {
      return JSON.stringify(JSON.parse(text), null, 2);
    } catch {
      return text;
    }
  }

  function callRow(call, n) {
    const name = `call-${n}`;
    const wants = call.awaiting || call.uncertain;
    const choices = el("div", { class: "choices" });
    const reason = el("input", { type: "text", class: "reason", placeholder: "why deny", "aria-label": `why deny ${visible(call.call_id)}`, hidden: "" });
    const edited = el("textarea", { class: "arguments", rows: 4, "aria-label": `arguments of ${visible(call.call_id)}`, hidden: "" });
    edited.value = prettyArguments(call.arguments);
    const output = el("textarea", { class: "output", rows: 3, placeholder: "the output it gave", "aria-label": `output of ${visible(call.call_id)}`, hidden: "" });
    const problem = el("p", { class: "field-error", hidden: "" });
    const show = () => {
      problem.hidden = true; // said of the choice before this one
      const chosen = choices.querySelector("input:checked");
      const value = chosen ? chosen.value : null;
      reason.hidden = value !== "deny";
      edited.hidden = value !== "edit";
      output.hidden = value !== "answer";
    };
    for (const [value, label] of choicesOf(call)) {
      const radio = el("input", { type: "radio", name, value });
      if (!wants && value === "approve") radio.checked = true;
      radio.addEventListener("change", show);
      choices.append(el("label", { class: `choice ${value}` }, radio, label));
    }
    const waits = call.uncertain ? "uncertain: it may or may not have run" : call.awaiting ? "awaits approval" : "needs no approval";
    const settled = call.denied !== null ? `denied: ${call.denied}` : call.answered !== null ? `answered: ${call.answered}` : null;
    const row = el("tr", { class: `call-form${call.uncertain ? " uncertain" : ""}${call.awaiting ? " awaiting" : ""}`, "data-call": call.call_id },
      el("td", { class: "id", text: call.call_id }),
      el("td", { text: call.name }),
      el("td", {}, el("pre", { text: prettyArguments(call.arguments) })),
      el("td", {}, el("p", { class: "dim", text: settled ? `${waits}; ${settled}` : waits }), choices, reason, edited, output, problem),
    );
    // The call's part of the request, or an error naming what is missing.
    const read = () => {
      problem.hidden = true;
      const chosen = choices.querySelector("input:checked");
      const fail = (text) => {
        problem.textContent = visible(text);
        problem.hidden = false;
        return { error: text };
      };
      if (!chosen) return fail("say what becomes of this call");
      switch (chosen.value) {
        case "deny":
          if (!reason.value.trim()) return fail("a denial needs a reason (the model reads it)");
          return { action: "deny", reason: reason.value };
        case "edit": {
          let parsed;
          try {
            parsed = JSON.parse(edited.value);
          } catch (error) {
            return fail(`the arguments are not JSON: ${error.message}`);
          }
          if (parsed === null || typeof parsed !== "object" || Array.isArray(parsed)) return fail("the arguments must be a JSON object");
          return { action: "edit", arguments: parsed };
        }
        case "answer":
          return { action: "answer", output: output.value };
        default:
          return { action: chosen.value };
      }
    };
    return { row, read, id: call.call_id };
  }

  function drawActions(data) {
    const acts = data.actions;
    document.getElementById("actions").hidden = !acts;
    document.getElementById("acting-as").textContent = data.user ? visible(`as ${data.user}`) : "";
    const resume = acts ? acts.resume : null;
    const key = JSON.stringify([data.summary.status, resume ? resume.seq : null]);
    if (key === formsFor) return; // the same pause: keep what the person filled in
    formsFor = key;
    resumeSeq = resume ? resume.seq : null;
    const body = document.querySelector("#calls-form tbody");
    clear(body);
    callChoices = [];
    document.getElementById("resume-form").hidden = !resume;
    const calls = resume ? resume.calls : null;
    document.getElementById("calls-form").hidden = !calls;
    document.getElementById("submit-calls").hidden = !calls;
    document.getElementById("proceed").hidden = !resume || Boolean(calls);
    const text = resume ? resume.text : null;
    document.getElementById("text-form").hidden = !text;
    if (text) {
      document.getElementById("rewrite-label").textContent =
        text.of === "model_message" ? "the model's answer (edit it, then go on)" : "the message (edit it, then go on)";
      document.getElementById("rewrite-text").value = text.content;
    }
    (calls || []).forEach((call, n) => {
      const drawn = callRow(call, n);
      body.append(drawn.row);
      callChoices.push(drawn);
    });
  }

  // A complaint about the forms goes once the person changes them.
  for (const id of ["resume-form", "cancel-form"]) {
    document.getElementById(id).addEventListener("input", () => {
      if (document.getElementById("action-status").classList.contains("bad")) say("");
    });
  }
  document.getElementById("resume-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const calls = {};
    let failed = false;
    for (const choice of callChoices) {
      const read = choice.read();
      if (read.error) failed = true;
      else calls[choice.id] = read;
    }
    if (failed) {
      say("some calls need a decision (see above)", "bad");
      return;
    }
    send({ kind: "resume", seq: resumeSeq, decision: "calls", calls });
  });
  document.getElementById("proceed").addEventListener("click", () => {
    send({ kind: "resume", seq: resumeSeq, decision: "proceed" });
  });
  document.getElementById("rewrite").addEventListener("click", () => {
    const text = document.getElementById("rewrite-text").value;
    if (!text.trim()) {
      say("the text cannot be empty: proceed or abort instead", "bad");
      return;
    }
    send({ kind: "resume", seq: resumeSeq, decision: "text", text });
  });
  document.getElementById("abort").addEventListener("click", () => {
    const reason = document.getElementById("abort-reason").value;
    if (!reason.trim()) {
      say("say why the loop is aborted", "bad");
      return;
    }
    send({ kind: "resume", seq: resumeSeq, decision: "abort", reason });
  });
  document.getElementById("cancel-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const reason = document.getElementById("cancel-reason").value;
    if (!reason.trim()) {
      say("say why the loop is cancelled", "bad");
      return;
    }
    send({ kind: "cancel", reason });
  });

  // A request's decision in words: what becomes of each call of a batch.
  function asked(r) {
    if (r.kind === "cancel") return `cancel: ${r.reason || ""}`;
    const d = r.decision;
    const at = `resume seq ${r.seq}`;
    if (!d || d.kind === "proceed") return `${at}: proceed`;
    if (d.kind === "abort") return `${at}: abort: ${d.reason}`;
    const batch = d.payload;
    if (batch && typeof batch.content === "string") return `${at}: rewrite the text: ${batch.content}`;
    if (!batch || batch.kind !== "tool_batch") return `${at}: ${d.kind}`;
    const own = (object, key) => Object.prototype.hasOwnProperty.call(object, key);
    const parts = batch.calls.map((c) => {
      if (own(batch.denied, c.call_id)) return `deny ${c.call_id} (${batch.denied[c.call_id]})`;
      if (own(batch.outputs, c.call_id)) return `answer ${c.call_id}: ${batch.outputs[c.call_id]}`;
      return `run ${c.call_id} ${c.name}(${c.arguments})`;
    });
    return `${at}: ${parts.join("; ")}`;
  }

  function drawRequests(requests) {
    const body = document.querySelector("#requests tbody");
    clear(body);
    for (const r of requests) {
      body.append(
        el("tr", { class: `request ${r.status}`, "data-request": r.id },
          el("td", { class: "num", text: r.id }),
          el("td", {}, el("details", {}, el("summary", { text: asked(r) }), el("pre", { text: JSON.stringify(r, null, 2) }))),
          el("td", { class: "by", text: r.by }),
          el("td", { text: r.created_at }),
          el("td", { class: "status", text: r.status }),
          el("td", { class: "note", text: r.note || (r.resolved_at ? `at ${r.resolved_at}` : "") }),
        ),
      );
    }
    document.getElementById("no-requests").hidden = requests.length > 0;
  }

  // ------------------------------------------------------------ breakpoints

  let agentId = null;

  function sayBreak(text, cls) {
    const box = document.getElementById("break-status");
    box.textContent = visible(text);
    box.className = `action-status ${cls || ""}`;
  }

  async function breakRequest(method, path, body) {
    const buttons = document.querySelectorAll("#breakpoints button");
    buttons.forEach((b) => { b.disabled = true; });
    sayBreak("sending…", "busy");
    try {
      const options = { method, headers: { "x-agentfsm-form": formToken }, cache: "no-store" };
      if (body) {
        options.headers["content-type"] = "application/json";
        options.body = JSON.stringify(body);
      }
      const answer = await fetch(api(path), options);
      const data = await answer.json().catch(() => ({}));
      if (answer.ok) {
        sayBreak(method === "DELETE" ? `breakpoint #${data.id} removed` : `breakpoint #${data.id} set: the runtimes watching the store pause there`, "ok");
      } else {
        sayBreak(`refused (${answer.status}): ${data.error || "no reason given"}`, "bad");
      }
    } catch (error) {
      sayBreak(`the server cannot be reached: ${error}`, "bad");
    } finally {
      buttons.forEach((b) => { b.disabled = false; });
    }
  }

  function drawBreakpoints(data) {
    agentId = data.summary.agent_id;
    document.getElementById("break-form").hidden = !data.actions;
    const body = document.querySelector("#breaks tbody");
    clear(body);
    for (const b of data.breakpoints) {
      const remove = el("button", { type: "button", class: "remove", text: "remove" });
      remove.addEventListener("click", () => breakRequest("DELETE", `breakpoints/${b.id}`));
      body.append(
        el("tr", { class: `break ${b.loop_id === null ? "agent" : "loop"}`, "data-break": b.id },
          el("td", { class: "num", text: b.id }),
          el("td", { class: "state", text: b.state === null ? "every transition (step mode)" : b.state }),
          el("td", { class: "scope", text: b.loop_id === null ? `agent ${b.agent_id}` : "this loop" }),
          el("td", { class: "by", text: b.by }),
          el("td", { text: b.created_at }),
          el("td", {}, data.actions ? remove : null),
        ),
      );
    }
    document.getElementById("no-breaks").hidden = data.breakpoints.length > 0;
  }

  document.getElementById("break-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const state = document.getElementById("break-state").value;
    const scope = document.getElementById("break-scope").value;
    const body = scope === "agent" ? { agent_id: agentId, state } : { loop_id: loopId, state };
    breakRequest("POST", "breakpoints", body);
  });
  document.getElementById("break-step").addEventListener("click", () => {
    breakRequest("POST", "breakpoints", { loop_id: loopId, every: true });
  });

  // ------------------------------------------------------- forks, replay

  const loopLink = (id) => `${agentfsm.root}/loop/${loopPath(id)}`;
  let pointsFor = null; // the fork points the select was filled with

  function sayFork(text, cls) {
    const box = document.getElementById("fork-status");
    box.textContent = visible(text);
    box.className = `action-status ${cls || ""}`;
  }

  // A fork's page: a link to its source and both paths side by side; any
  // loop's page: the forks asked of it, and the form to ask one.
  function drawForks(data) {
    const fork = data.fork;
    const origin = fork.from;
    document.getElementById("fork-of").hidden = !origin;
    if (origin) {
      const link = document.getElementById("fork-source");
      link.textContent = visible(origin.loop_id);
      link.href = loopLink(origin.loop_id);
      document.getElementById("fork-seq-of").textContent = String(origin.seq);
      if (origin.graph) drawGraph(origin.graph, document.getElementById("source-diagram"), null);
      document.getElementById("source-caption").textContent = origin.graph ? "the source" : "the source (not in this store)";
      drawGraph(data.graph, document.getElementById("fork-diagram"), null);
    }
    const form = document.getElementById("fork-form");
    form.hidden = !fork.enabled || fork.points.length === 0;
    const key = JSON.stringify(fork.points);
    if (key !== pointsFor) {
      pointsFor = key;
      const select = document.getElementById("fork-at");
      const chosen = select.value;
      clear(select);
      for (const seq of fork.points) select.append(el("option", { value: seq, text: String(seq) }));
      if (chosen && fork.points.includes(Number(chosen))) select.value = chosen;
    }
    const body = document.querySelector("#forks tbody");
    clear(body);
    for (const f of fork.forks) {
      const loop = f.loop_id ? el("a", { href: loopLink(f.loop_id), class: "fork-loop", text: f.loop_id }) : f.note || "";
      body.append(
        el("tr", { class: `fork ${f.status}`, "data-request": f.request },
          el("td", { class: "num", text: f.request }),
          el("td", { class: "num", text: f.seq }),
          el("td", { text: f.model || "the recorded one" }),
          el("td", { class: "by", text: f.by }),
          el("td", { class: "status", text: f.status }),
          el("td", {}, loop),
        ),
      );
    }
    document.getElementById("no-forks").hidden = fork.forks.length > 0;
    document.getElementById("replay-box").hidden = data.summary.status !== "done" || !data.events_kept;
  }

  document.getElementById("fork-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    const seq = Number(document.getElementById("fork-at").value);
    const model = document.getElementById("fork-model").value.trim();
    const body = { kind: "fork", seq };
    if (model) body.model = model;
    const button = document.getElementById("fork");
    button.disabled = true;
    sayFork("sending…", "busy");
    try {
      const answer = await fetch(requestsUrl(loopId), {
        method: "POST",
        headers: { "content-type": "application/json", "x-agentfsm-form": formToken },
        body: JSON.stringify(body),
        cache: "no-store",
      });
      const data = await answer.json().catch(() => ({}));
      if (answer.status === 202) {
        sayFork(`fork request #${data.id} stored, pending: a runtime watching the store with the loop's tools starts it`, "ok");
      } else {
        sayFork(`refused (${answer.status}): ${data.error || "no reason given"}`, "bad");
      }
    } catch (error) {
      sayFork(`the server cannot be reached: ${error}`, "bad");
    } finally {
      button.disabled = false;
    }
  });

  function replayUrl(id) {
    const where = id === "." || id === ".." ? `/replay?id=${encodeURIComponent(id)}` : `${encodeURIComponent(id)}/replay`;
    return api(`loops/${where}`);
  }

  document.getElementById("replay").addEventListener("click", async () => {
    const button = document.getElementById("replay");
    const status = document.getElementById("replay-status");
    const result = document.getElementById("replay-result");
    const table = document.getElementById("replay-differences");
    button.disabled = true;
    status.textContent = "replaying…";
    status.className = "action-status busy";
    result.hidden = true;
    table.hidden = true;
    try {
      const answer = await fetch(replayUrl(loopId), { method: "POST", headers: { "x-agentfsm-form": formToken }, cache: "no-store" });
      const data = await answer.json().catch(() => ({}));
      if (!answer.ok) {
        status.textContent = visible(`refused (${answer.status}): ${data.error || "no reason given"}`);
        status.className = "action-status bad";
        return;
      }
      if (data.error) {
        status.textContent = visible(data.error);
        status.className = "action-status bad";
        return;
      }
      status.textContent = visible(data.diverged ? `diverged (handlers: ${data.handlers})` : `no divergence (handlers: ${data.handlers})`);
      status.className = `action-status ${data.diverged ? "bad" : "ok"}`;
      result.textContent = visible(data.text);
      result.className = data.diverged ? "diverged" : "same";
      result.hidden = false;
      const body = table.querySelector("tbody");
      clear(body);
      const differences = data.divergence ? data.divergence.differences : [];
      for (const d of differences) {
        body.append(el("tr", { class: "difference" },
          el("td", { text: d.path }),
          el("td", {}, el("pre", { text: JSON.stringify(d.expected) })),
          el("td", {}, el("pre", { text: JSON.stringify(d.actual) })),
        ));
      }
      table.hidden = differences.length === 0;
    } catch (error) {
      status.textContent = visible(`the server cannot be reached: ${error}`);
      status.className = "action-status bad";
    } finally {
      button.disabled = false;
    }
  });

  function draw(data) {
    drawSummary(data);
    drawActions(data);
    drawGraph(data.graph);
    addRows(data);
    drawLedger(data.ledger);
    drawDecisions(data.decisions);
    drawRequests(data.requests);
    drawForks(data);
    drawBreakpoints(data);
    addItems(data);
  }

  live(`stream/loops/${loopPath(loopId)}`, {
    loop: draw,
    missing: (data) => {
      document.getElementById("summary").textContent = visible(data.error);
    },
  });
})();
