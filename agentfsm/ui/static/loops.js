// The loops page: the list, its counts and filters, redrawn from each
// `loops` event of the stream.
"use strict";

(() => {
  const { el, clear, age, tokens, live, root, loopPath } = agentfsm;
  const status = document.getElementById("status");
  const agent = document.getElementById("agent");
  const params = new URLSearchParams(location.search);
  status.value = params.get("status") || "";
  let wantedAgent = params.get("agent") || "";
  let source = null;

  function why(loop) {
    if (loop.status === "paused") {
      const calls = loop.pending_calls && loop.pending_calls.length ? ` [${loop.pending_calls.join(", ")}]` : "";
      return (loop.pause_reason || "paused") + calls;
    }
    if (loop.status === "done") return loop.outcome + (loop.error ? `: ${loop.error}` : loop.reason ? `: ${loop.reason}` : "");
    return "";
  }

  function owner(loop) {
    if (!loop.owner) return "";
    if (!loop.lease_until) return loop.owner;
    return `${loop.owner} (${loop.lease_live ? "lease live" : "lease expired"})`;
  }

  function draw(data) {
    const counts = document.getElementById("counts");
    clear(counts);
    for (const [name, count] of Object.entries(data.counts)) {
      counts.append(el("span", { class: `count ${name}`, "data-status": name, text: `${name} ${count}` }));
    }
    if (data.breakpoints) {
      counts.append(el("span", { class: "count breakpoints", "data-status": "breakpoints", text: `breakpoints ${data.breakpoints}` }));
    }
    const known = new Set(Array.from(agent.options).map((o) => o.value));
    for (const name of data.agents) {
      if (!known.has(name)) agent.append(el("option", { value: name, text: name }));
    }
    agent.value = wantedAgent;
    const body = document.querySelector("#loops tbody");
    clear(body);
    for (const loop of data.loops) {
      const link = el("a", { href: `${root}/loop/${loopPath(loop.loop_id)}`, text: loop.loop_id });
      body.append(
        el("tr", { class: `loop ${loop.status}`, "data-loop": loop.loop_id },
          el("td", { class: "id" }, link),
          el("td", { text: loop.agent_id }),
          el("td", { class: "status", text: loop.status }),
          el("td", { class: "state", text: loop.state }),
          el("td", { class: "num", text: loop.model_requests }),
          el("td", { class: "num", text: loop.tool_calls }),
          el("td", { class: "num", text: tokens(loop.usage) }),
          el("td", { class: "num", text: age(loop.started_at, data.now) }),
          el("td", { class: "owner", text: owner(loop) }),
          el("td", { class: "why", text: why(loop) }),
        ),
      );
    }
    document.getElementById("empty").hidden = data.loops.length > 0;
    const bad = document.getElementById("unreadable");
    bad.hidden = data.unreadable.length === 0;
    const list = bad.querySelector("ul");
    clear(list);
    for (const u of data.unreadable) list.append(el("li", { text: `${u.loop_id}: ${u.reason}` }));
  }

  function connect() {
    if (source) source.close();
    const query = new URLSearchParams();
    if (status.value) query.set("status", status.value);
    if (wantedAgent) query.set("agent", wantedAgent);
    const text = query.toString();
    history.replaceState(null, "", text ? `?${text}` : location.pathname);
    source = live(`stream/loops${text ? `?${text}` : ""}`, { loops: draw });
  }

  status.addEventListener("change", connect);
  agent.addEventListener("change", () => {
    wantedAgent = agent.value;
    connect();
  });
  connect();
})();
