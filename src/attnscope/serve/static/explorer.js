/* attnscope explorer: the page of `attnscope serve`.
 *
 * It asks the JSON API (/api/models, /api/analyze, /api/intervene, /api/record), mounts the head / model /
 * neuron views of present/static (AttnscopeViews.mount), and draws around them the pattern map,
 * the statistics table and the intervention panel. The page address keeps the state
 * (#model=..&text=..&pair=..&view=head&layer=2&head=3&norms=1&do=zero&heads=2.3&layers=&on=&show=changed;
 * measure=alti&rollout=1 for a context-mixing measure) so a view can be bookmarked or shared. The
 * views' Measure control offers the context-mixing measures of GET /api/models and fetches the one
 * chosen for the analysed text from POST /api/mixing. Clicking an attention cell (the head view: a query
 * token, then a key token, with one head shown; the step view: a token of a step's row, with one layer
 * and head chosen) asks POST /api/qk why the head looked there and draws its top pairs (QK attribution).
 * The Generate tab's "routes" box asks /api/generate for each step's route (the step view draws the chosen step's);
 * its KV budget fields (a share of full KV heads; empty = none) ask it to generate under a budget, whose streamed
 * heads and bytes held it draws above the steps;
 * the Routes tab asks POST /api/routes for one prediction's route and draws it (routes.js); the Sentences tab asks
 * POST /api/sentences for a text's sentence-level attention and draws its panel (sentences.js).
 * The Head functions tab offers the registered head-function scores of GET /api/models, asks POST /api/head-scores
 * for one score of every head and draws the grid; a click on a head asks POST /api/head-trial for that head's row on
 * one trial of the score's task (head_functions.js draws both).
 * Layers and heads are 0-indexed.
 */
(function (V, Steps, Routes, Sentences, Heads) {
  "use strict";

  const el = V.element;
  const $ = (id) => document.getElementById(id);
  const page = {
    config: null, // GET /api/models
    analysis: null, // the last /api/analyze answer (the intact model)
    change: null, // the last /api/intervene answer, for the same input
    showing: "intact", // which of the two the views, map and table show
    open: null, // [layer, head] open in the views
    sort: { column: null, descending: true },
    views: null, // the mounted AttnscopeViews app
    generated: null, // the last /api/generate answer
    qkHint: null, // what the head view's QK panel says before a cell is clicked
  };

  // ---- talking to the server ----------------------------------------------------------------
  /* GET `path`, or POST `body` as JSON (the server runs models only for JSON POSTs); the
   * response, or an Error with the server's one-line detail. */
  async function ask(path, body) {
    const options = body === undefined ? {} : {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
    };
    const response = await fetch(path, options);
    if (response.ok) return response;
    const data = await response.json().catch(() => ({}));
    throw new Error(data.detail || `the server answered ${response.status}`);
  }

  async function api(path, body) {
    return (await ask(path, body)).json();
  }

  function setStatus(text, isError) {
    const status = $("status");
    status.textContent = text;
    status.classList.toggle("ex-error", !!isError);
  }

  /* Run `work` with the buttons disabled; an error is shown and everything on the page stays. */
  async function busy(message, work) {
    const buttons = [$("analyze"), $("run-change")];
    buttons.forEach((button) => { button.disabled = true; });
    setStatus(message);
    try {
      await work();
      setStatus("");
    } catch (error) {
      setStatus(error.message, true);
    } finally {
      buttons.forEach((button) => { button.disabled = false; });
    }
  }

  // ---- the page address -------------------------------------------------------------------
  const address = () => new URLSearchParams(window.location.hash.replace(/^#/, ""));

  function writeAddress() {
    const data = page.analysis;
    if (!data) return;
    const asked = new URLSearchParams({ model: data.model.name, text: data.text });
    if (data.pair) asked.set("pair", data.pair);
    const app = page.views;
    if (app) {
      asked.set("view", app.state.view);
      if (app.state.kind) asked.set("kind", String(app.state.kind));
      asked.set("layer", String(app.state.layer));
      if (app.state.heads.size === 1) asked.set("head", String([...app.state.heads][0]));
      if (app.state.measure === "norms") asked.set("norms", "1");
      else if (app.state.measure !== "attention") asked.set("measure", app.state.measure);
      if (app.layerLevel() && app.state.rollout) asked.set("rollout", "1");
    }
    if (page.change) {
      asked.set("do", $("mode").value);
      if ($("change-heads").value.trim()) asked.set("heads", $("change-heads").value.replace(/\s+/g, ""));
      if ($("change-layers").value.trim()) asked.set("layers", $("change-layers").value.replace(/\s+/g, ""));
      if ($("kind").value) asked.set("on", $("kind").value);
      if (page.showing === "changed") asked.set("show", "changed");
    }
    window.history.replaceState(null, "", `#${asked}`);
  }

  // ---- analysis ----------------------------------------------------------------------------
  function inputBody() {
    const pair = $("pair").value.trim();
    return { model: $("model").value, text: $("text").value, pair: pair || null };
  }

  /* The analysed input's attention as a JSON file (POST /api/record, saved through a blob: link). */
  async function downloadRecord() {
    if (!page.analysis) return;
    await busy("preparing the JSON\u2026", async () => {
      const { model, text, pair } = page.analysis;
      const blob = await (await ask("/api/record", { model: model.name, text, pair })).blob();
      const link = el("a");
      link.href = URL.createObjectURL(blob);
      link.download = `attention-${model.name}.json`;
      link.click();
      setTimeout(() => URL.revokeObjectURL(link.href), 60000);
    });
  }

  async function analyze(fromAddress) {
    if (!$("text").value.trim()) {  // said here, without asking the server; what is shown stays
      setStatus("nothing to analyse: type a text first (a second sentence is optional)", true);
      $("text").focus();
      return;
    }
    await busy("analyzing\u2026", async () => {
      const data = await api("/api/analyze", inputBody());
      page.analysis = data;
      page.change = null;
      page.showing = "intact";
      page.sort = { column: null, descending: true };
      $("effects").replaceChildren();
      $("qk-panel").replaceChildren(...page.qkHint.map((node) => node.cloneNode(true)));
      delete $("qk-panel").dataset.state;
      $("showing").hidden = true;
      $("results").hidden = false;
      setupIntervention(data.model);
      render(fromAddress);
      markLoaded(data.model.name);
    });
  }

  function shown() { return page.showing === "changed" && page.change ? page.change : page.analysis; }

  function render(fromAddress) {
    const data = shown();
    mountViews(data.payload, fromAddress);
    drawPatternMap(data.patterns);
    drawStatistics(data);
    writeAddress();
  }

  /* Mount the views for `payload`, keeping what the previous views showed (view, layer, heads, norms). */
  function mountViews(payload, fromAddress) {
    const previous = page.views;
    const root = $("views");
    root.replaceChildren();
    delete root.dataset.drawn;
    const app = V.mount(root, payload, { hash: !!fromAddress, onChange: viewsChanged, mixing: mixingSource(),
      onCell: headCell });
    if (previous && !fromAddress) {
      const state = app.state;
      if (payload.views.includes(previous.state.view)) state.view = previous.state.view;
      state.kind = Math.min(previous.state.kind, payload.kinds.length - 1);
      state.layer = previous.state.layer;
      state.heads = new Set([...previous.state.heads].filter((h) => h < app.nHeads()));
      state.measure = previous.state.measure; // falls back to α where it is not offered
      state.rollout = previous.state.rollout;
      app.syncControls();
      app.draw();
    }
    page.views = app;
  }

  /* The context-mixing measures the views may fetch for the analysed text (POST /api/mixing): only
   * for the intact model (the measures are of the model as it is), and for one text (an
   * encoder-decoder's second text is its target, which the encoder never sees). */
  function mixingSource() {
    const data = page.analysis;
    if (!data || page.showing === "changed" || (data.pair && data.model.type !== "encoder-decoder")) return null;
    const fetchOne = async (method) => {
      const answer = await api("/api/mixing", { model: data.model.name, text: data.text, pair: data.pair, method });
      return answer.mixing;
    };
    return { methods: page.config.measures || [], fetch: fetchOne };
  }

  /* After each draw of the views: follow the open head and the norm toggle, keep the address. */
  function viewsChanged(app) {
    const heads = [...app.state.heads];
    page.open = app.state.kind === 0 && heads.length === 1 ? [app.state.layer, heads[0]] : null;
    for (const cell of $("pattern-map").querySelectorAll(".ex-cell")) {
      cell.classList.toggle("ex-open", !!page.open && +cell.dataset.layer === page.open[0] && +cell.dataset.head === page.open[1]);
    }
    for (const row of $("stats").querySelectorAll("tbody tr")) {
      row.classList.toggle("ex-open", !!page.open && +row.dataset.layer === page.open[0] && +row.dataset.head === page.open[1]);
    }
    const norms = app.state.measure === "norms";
    if ($("norms").checked !== norms) {
      $("norms").checked = norms;
      drawStatistics(shown());
    }
    writeAddress();
  }

  function openHead(layer, head) {
    const app = page.views;
    app.state.kind = 0; // the pattern map and the table are about the input side's attention
    return app.openHead(layer, head);
  }

  // ---- pattern map -------------------------------------------------------------------------
  function classOf(name) {
    return page.config.classes.find((c) => c.name === name) || { name, short: name.slice(0, 4), colour: "#ccc", description: "" };
  }

  function drawPatternMap(patterns) {
    const grid = $("pattern-map");
    const labels = patterns.labels;
    const heads = labels[0].length;
    grid.style.gridTemplateColumns = `28px repeat(${heads}, minmax(22px, 1fr))`;
    const cells = [el("span", "ex-axis", "")];
    for (let h = 0; h < heads; h++) cells.push(el("span", "ex-axis", `h${h}`));
    labels.forEach((row, layer) => {
      cells.push(el("span", "ex-axis", `L${layer}`));
      row.forEach((name, head) => {
        const kind = classOf(name);
        const confidence = patterns.confidence[layer][head] ?? 0;
        const cell = el("button", "ex-cell", kind.short);
        cell.type = "button";
        cell.dataset.layer = String(layer);
        cell.dataset.head = String(head);
        cell.dataset.label = name;
        cell.style.background = kind.colour;
        cell.style.opacity = String(0.35 + 0.65 * Math.max(0, Math.min(1, confidence)));
        cell.title = `layer ${layer}, head ${head}: ${name} (confidence ${confidence.toFixed(2)}): ${kind.description}`;
        cell.addEventListener("click", () => openHead(layer, head));
        cells.push(cell);
      });
    });
    grid.replaceChildren(...cells);
    markChangedHeads();
    const used = new Set(labels.flat());
    $("legend").replaceChildren(...page.config.classes.filter((c) => used.has(c.name)).map((c) => {
      const item = el("span", "", "");
      const swatch = el("span", "ex-swatch");
      swatch.style.background = c.colour;
      item.append(swatch, `${c.short} = ${c.name.replace(/_/g, " ")}`);
      item.title = `${c.description} (${c.source}; Kovaleva type: ${c.kovaleva})`;
      return item;
    }));
  }

  function markChangedHeads() {
    let marked, layers;
    try {
      marked = new Set(parseHeads().map(({ layer, head }) => `${layer}.${head}`));
      layers = new Set(parseLayers());
    } catch (error) {
      return; // the fields hold a typo; Run will say so
    }
    for (const cell of $("pattern-map").querySelectorAll(".ex-cell")) {
      const on = page.change && (marked.has(`${cell.dataset.layer}.${cell.dataset.head}`) || layers.has(+cell.dataset.layer));
      cell.classList.toggle("ex-marked", !!on);
    }
  }

  // ---- statistics table --------------------------------------------------------------------
  function statisticColumns(data) {
    const names = Object.keys(data.statistics);
    const norms = $("norms").checked;
    return names.filter((name) => !name.startsWith("norm_"))
      .map((name) => (norms && names.includes(`norm_${name}`) ? `norm_${name}` : name));
  }

  function drawStatistics(data) {
    const columns = ["layer", "head", "pattern", "confidence", ...statisticColumns(data)];
    const rows = [];
    data.patterns.labels.forEach((labels, layer) => labels.forEach((label, head) => {
      const row = { layer, head, pattern: label, confidence: data.patterns.confidence[layer][head] };
      for (const name of columns.slice(4)) row[name] = data.statistics[name][layer][head];
      rows.push(row);
    }));
    const { column, descending } = page.sort;
    if (column && columns.includes(column)) {
      const value = (row) => (row[column] === null ? -Infinity : row[column]);
      rows.sort((a, b) => (value(a) < value(b) ? -1 : value(a) > value(b) ? 1 : 0) * (descending ? -1 : 1));
    }
    const header = el("tr");
    for (const name of columns) {
      const th = el("th", "", name.replace(/^norm_/, "\u2016\u03b1f\u2016 ") + (name === column ? (descending ? " \u25bc" : " \u25b2") : ""));
      th.dataset.column = name;
      th.title = data.statistic_descriptions[name] || { layer: "0-indexed layer", head: "0-indexed head",
        pattern: "the head's pattern on this input", confidence: "how clearly (0-1)" }[name] || "";
      th.addEventListener("click", () => {
        page.sort = { column: name, descending: page.sort.column === name ? !page.sort.descending : true };
        drawStatistics(shown());
      });
      header.append(th);
    }
    const body = el("tbody");
    for (const row of rows) {
      const tr = el("tr");
      tr.dataset.layer = String(row.layer);
      tr.dataset.head = String(row.head);
      tr.classList.toggle("ex-open", !!page.open && page.open[0] === row.layer && page.open[1] === row.head);
      for (const name of columns) {
        const value = row[name];
        const text = typeof value === "number" && !Number.isInteger(value) ? value.toFixed(3) : value === null ? "\u2013" : String(value);
        tr.append(el("td", name === "pattern" ? "ex-label" : "", text));
      }
      tr.addEventListener("click", () => openHead(row.layer, row.head));
      body.append(tr);
    }
    const head = el("thead");
    head.append(header);
    $("stats").replaceChildren(head, body);
  }

  function setNorms(on) {
    const app = page.views;
    drawStatistics(shown());
    app.setMeasure(on && app.kind().norms ? "norms" : "attention");
  }

  // ---- interventions -----------------------------------------------------------------------
  function setupIntervention(model) {
    const kinds = Object.keys(model.kinds);
    const select = $("kind");
    const current = select.value;
    select.replaceChildren(...kinds.map((kind) => new Option(kind, kind === model.main_kind ? "" : kind)));
    select.value = kinds.includes(current) ? current : "";
    $("kind-field").hidden = kinds.length < 2;
  }

  function numbers(text) {
    return text.split(",").map((part) => part.trim()).filter(Boolean);
  }

  function parseHeads() {
    return numbers($("change-heads").value).map((part) => {
      const match = /^(\d+)\.(\d+)$/.exec(part);
      if (!match) throw new Error(`cannot read head "${part}": write layer.head, e.g. 2.3`);
      return { layer: Number(match[1]), head: Number(match[2]) };
    });
  }

  function parseLayers() {
    return numbers($("change-layers").value).map((part) => {
      if (!/^\d+$/.test(part)) throw new Error(`cannot read layer "${part}": write a number, e.g. 3`);
      return Number(part);
    });
  }

  function addOpenHead() {
    if (!page.open) {
      setStatus("open one head first (click a cell of the pattern map)", true);
      return;
    }
    const heads = numbers($("change-heads").value);
    const name = `${page.open[0]}.${page.open[1]}`;
    if (!heads.includes(name)) heads.push(name);
    $("change-heads").value = heads.join(", ");
  }

  async function runChange() {
    if (!page.analysis) return;
    await busy("running the intervention\u2026", async () => {
      const body = {
        model: page.analysis.model.name, text: page.analysis.text, pair: page.analysis.pair,
        mode: $("mode").value, heads: parseHeads(), layers: parseLayers(), kind: $("kind").value || null,
      };
      const data = await api("/api/intervene", body);
      page.change = data;
      $("showing-change").textContent = data.change;
      $("showing").hidden = false;
      drawEffects(data);
      markChangedHeads();
      writeAddress();
    });
  }

  function showChanged(which) {
    page.showing = which;
    for (const radio of document.querySelectorAll("input[name=showing]")) radio.checked = radio.value === which;
    render(false);
  }

  /* A layers x heads grid of values in [0, 1] (darker = larger). */
  function heatGrid(values, title) {
    const grid = el("div", "ex-grid");
    grid.dataset.role = "change-grid";
    const heads = values[0].length;
    grid.style.gridTemplateColumns = `28px repeat(${heads}, minmax(18px, 1fr))`;
    const largest = Math.max(1e-9, ...values.flat().map((v) => v || 0));
    grid.append(el("span", "ex-axis", ""));
    for (let h = 0; h < heads; h++) grid.append(el("span", "ex-axis", `h${h}`));
    values.forEach((row, layer) => {
      grid.append(el("span", "ex-axis", `L${layer}`));
      row.forEach((value, head) => {
        const cell = el("span", "ex-cell", value > 0.0005 ? value.toFixed(2).replace(/^0/, "") : "");
        cell.style.background = `rgba(225, 87, 89, ${((value || 0) / largest).toFixed(3)})`;
        cell.title = `${title}, layer ${layer}, head ${head}: ${(value || 0).toFixed(4)}`;
        grid.append(cell);
      });
    });
    return grid;
  }

  function drawEffects(data) {
    const box = $("effects");
    const parts = [el("p", "", `${data.change}: ${data.mode_description}.`)];
    const output = data.output;
    parts.push(el("h3", "", "What the model outputs"));
    if (output.type === "embedding") parts.push(...embeddingEffect(output));
    if (output.type === "next_token") parts.push(...nextTokenEffect(output));
    if (output.type === "translation") parts.push(...translationEffect(output));
    for (const [kind, values] of Object.entries(data.attention_change)) {
      parts.push(el("h3", "", `How ${kind} attention changed`));
      parts.push(el("p", "ex-note", "per head, the mean over queries of the total-variation distance between its intact and changed attention (0 = same, 1 = disjoint)"));
      parts.push(heatGrid(values, `${kind} attention change`));
    }
    box.replaceChildren(...parts);
    box.dataset.state = "done";
  }

  function embeddingEffect(output) {
    const value = el("div", "ex-big", `cosine ${output.cosine.toFixed(4)}`);
    value.dataset.role = "cosine";
    const strip = el("div", "ex-tokens");
    output.tokens.forEach((token, i) => {
      const span = el("span", "", token);
      const moved = Math.min(1, Math.max(0, 1 - output.token_cosine[i]) * 5);
      span.style.background = `rgba(225, 87, 89, ${moved.toFixed(3)})`;
      span.title = `${token}: cosine ${output.token_cosine[i].toFixed(4)}`;
      strip.append(span);
    });
    return [value, el("p", "ex-note", output.what), strip];
  }

  function nextTokenEffect(output) {
    const table = el("table", "ex-bars");
    table.dataset.role = "next-token";
    const head = el("tr");
    head.append(el("th", "", "intact"), el("th", "", ""), el("th", "", "after the change"), el("th", "", ""));
    table.append(head);
    output.intact.forEach((before, i) => {
      const after = output.changed[i];
      const row = el("tr");
      for (const [item, cls] of [[before, "ex-bar"], [after, "ex-bar ex-after"]]) {
        const bar = el("span", cls);
        bar.style.width = `${Math.round(120 * item.probability)}px`;
        row.append(el("td", "", JSON.stringify(item.token)), el("td", "", ""));
        row.lastChild.append(bar, ` ${item.probability.toFixed(3)}`);
      }
      table.append(row);
    });
    return [el("p", "", `KL(intact \u2016 changed) = ${output.kl_divergence.toFixed(4)} nats`), table, el("p", "ex-note", output.what)];
  }

  function translationEffect(output) {
    const lines = el("div");
    lines.dataset.role = "translation";
    lines.append(el("div", "", `intact: ${output.intact}`), el("div", "ex-big", `changed: ${output.changed}`));
    const blocks = [["intact model", output.intact_steps], ["after the change", output.changed_steps]].map(([name, trace]) => {
      const details = el("details");
      details.append(el("summary", "", `step view, ${name}`));
      const holder = el("div");
      Steps.render(holder, trace);
      details.append(holder);
      return details;
    });
    blocks[1].open = true;
    return [lines, el("p", "ex-note", output.what), ...blocks];
  }

  // ---- why a head looked there: QK attribution of one cell (POST /api/qk) --------------------
  /* Ask /api/qk for `body` ({model, text or ids, layer, head, query, key}) and draw in `box` the score and the
   * top pairs of both tables, each with a signed bar; the server's one line where it refuses. */
  async function explainCell(box, body) {
    box.dataset.state = "busy";
    box.replaceChildren(el("p", "ex-note", `asking why layer ${body.layer}, head ${body.head} looked from query `
      + `${body.query} to key ${body.key}\u2026`));
    try {
      const data = await api("/api/qk", body);
      box.replaceChildren(...qkParts(data));
      box.dataset.state = "done";
    } catch (error) {
      refuseCell(box, error.message);
    }
  }

  function refuseCell(box, reason) {
    box.replaceChildren(el("p", "ex-error", reason));
    box.dataset.state = "error";
  }

  function qkParts(data) {
    const token = (i) => JSON.stringify(data.tokens[i]);
    const capped = data.capped_score === null ? "" : ` (${data.capped_score.toFixed(3)} after the softcap)`;
    const score = el("p", "", `score ${data.score.toFixed(3)}${capped}; the ${data.components} \u00d7 ${data.components} `
      + `table sums to ${data.table_sum.toFixed(3)}; log attention ${data.log_attention.toFixed(3)}`);
    score.dataset.role = "qk-summary";
    const parts = [el("h3", "", `Why layer ${data.layer}, head ${data.head} looks from query ${data.query} `
      + `${token(data.query)} to key ${data.key} ${token(data.key)}`), score,
    el("p", "ex-note", "the largest terms of the score: a query-side component (what the query's residual holds) "
      + "times a key-side component (what the key's holds); red adds to the score, blue takes away"),
    pairTable(data.top.score, "score")];
    if (data.top.centred) {
      parts.push(el("p", "ex-note", "what the softmax sees: each key-side component minus its attention-weighted mean "
        + `over the row's keys; these terms plus the row term ${data.row_term.toFixed(3)} sum to the log attention`),
      pairTable(data.top.centred, "centred"));
    }
    return parts;
  }

  function pairTable(pairs, table) {
    const box = el("table", "ex-bars");
    box.dataset.role = `qk-${table}`;
    const head = el("tr");
    for (const name of ["query component", "key component", "term"]) head.append(el("th", "", name));
    box.append(head);
    const largest = Math.max(1e-12, ...pairs.map((pair) => Math.abs(pair.value)));
    for (const pair of pairs) {
      const bar = el("span", `ex-bar ${pair.value < 0 ? "ex-negative" : "ex-positive"}`);
      bar.style.width = `${Math.round((100 * Math.abs(pair.value)) / largest)}px`;
      const value = el("td");
      value.dataset.value = String(pair.value);
      value.append(bar, ` ${pair.value.toFixed(4)}`);
      const row = el("tr");
      row.append(el("td", "", pair.query_component), el("td", "", pair.key_component), value);
      box.append(row);
    }
    return box;
  }

  /* The head view's cell (selected query, clicked key) of its layer and its one head shown, on the intact model. */
  function headCell(app, query, key) {
    const box = $("qk-panel");
    const data = page.analysis;
    const heads = [...app.state.heads];
    const reason = app.layerLevel() ? "a context-mixing measure has no heads: choose attention \u03b1 to ask why a head looked there"
      : heads.length !== 1 ? "show one head only (double-click its square) to ask why it looked there"
        : page.showing === "changed" ? "QK attribution reads the intact model: show the intact model to ask"
          : data.pair ? "QK attribution reads one text: analyse it without a second sentence to ask" : null;
    if (reason) return refuseCell(box, reason);
    return explainCell(box, { model: data.model.name, text: data.text, layer: Number(app.layerName(app.state.layer)),
      head: heads[0], query, key });
  }

  /* The step view's cell: the step's query (the last token so far) and the clicked key, of its layer and head. */
  function stepCell(view, key) {
    const box = $("gen-qk");
    const { layer, head, step } = view.state;
    if (layer < 0 || head < 0) return refuseCell(box, "choose one layer and one head above to ask why it looked there");
    const query = view.payload.keys[step] - 1;
    return explainCell(box, { model: page.generated.model, ids: page.generated.token_ids.slice(0, query + 1),
      layer, head, query, key });
  }

  // ---- generation tab ------------------------------------------------------------------------
  function showTab(name) {
    for (const tab of document.querySelectorAll(".ex-tabs [data-tab]")) {
      tab.setAttribute("aria-selected", String(tab.dataset.tab === name));
      $(`${tab.dataset.tab}-tab`).hidden = tab.dataset.tab !== name;
    }
  }

  /* POST /api/generate and draw the step view of what the model wrote (the same view as
   * `attnscope generate --html`); an error is shown and the last drawing stays. */
  async function generate() {
    const status = $("gen-status");
    const button = $("generate");
    button.disabled = true;
    status.classList.remove("ex-error");
    status.textContent = "generating…";
    try {
      const body = { model: $("gen-model").value, prompt: $("gen-prompt").value,
        max_new_tokens: Number($("gen-tokens").value), chat: $("gen-chat").checked,
        prompt_rows: $("gen-prompt-rows").value, attribute: $("gen-attribute").checked, lens: $("gen-lens").checked,
        routes: $("gen-routes").checked,
        ...budgetAsked() };
      const data = await api("/api/generate", body);
      const holder = $("gen-steps");
      delete holder.dataset.drawn;
      page.generated = data;
      $("gen-qk").replaceChildren();
      drawBudget(data.kv_budget);
      await Steps.render(holder, data.payload, { focus: true, onKey: stepCell });
      markLoaded(data.model);
      status.textContent = "";
    } catch (error) {
      status.textContent = error.message;
      status.classList.add("ex-error");
    } finally {
      button.disabled = false;
    }
  }

  /* The KV budget fields of the request: none while the share is empty (no budget). */
  function budgetAsked() {
    const share = $("gen-kv-share").value.trim();
    if (share === "") return {};
    return { kv_share: Number(share), kv_sink: Number($("gen-kv-sink").value), kv_window: Number($("gen-kv-window").value),
      kv_choose: $("gen-kv-choose").value, kv_seed: Number($("gen-kv-seed").value) };
  }

  /* The KV budget a generation ran under (the answer's kv_budget, null without one): a KV head x layer grid of
   * full, streamed and model-windowed heads, and the key/value bytes held against a plain cache's. */
  function drawBudget(budget) {
    const box = $("gen-budget");
    delete box.dataset.streamed;
    if (!budget) { box.replaceChildren(); return; }
    const layers = budget.full.length;
    const grid = el("div", "ex-grid ex-kv-grid");
    grid.style.gridTemplateColumns = `40px repeat(${layers}, minmax(12px, 1fr))`;
    const cells = [el("span", "ex-axis", "")];
    for (let layer = 0; layer < layers; layer++) cells.push(el("span", "ex-axis", `L${layer}`));
    budget.full[0].forEach((_, kvHead) => {
      cells.push(el("span", "ex-axis", `kv${kvHead}`));
      for (let layer = 0; layer < layers; layer++) {
        const state = budget.windows[layer] ? "windowed" : budget.full[layer][kvHead] ? "full" : "streamed";
        const cell = el("span", `ex-kv ex-kv-${state}`, state === "streamed" ? "s" : state === "windowed" ? "w" : "");
        Object.assign(cell.dataset, { layer: String(layer), kvHead: String(kvHead), state });
        cell.title = `layer ${layer}, KV head ${kvHead}: ` + (state === "full" ? "full (every key)"
          : state === "streamed" ? `streamed (the first ${budget.sink} keys and the ${budget.window} most recent)`
            : `windowed by the model itself (${budget.windows[layer]} keys)`);
        cells.push(cell);
      }
    });
    grid.replaceChildren(...cells);
    const bytes = (n) => `${n.toLocaleString("en-US")} bytes`;
    const summary = el("p", "ex-note", `KV budget: ${budget.streamed.length} KV heads streamed (sink ${budget.sink} + `
      + `window ${budget.window}), ${Math.round(100 * budget.share)}% full, chosen by ${budget.chosen_by}. Keys and values `
      + `held after ${budget.tokens} tokens: ${bytes(budget.bytes)} of a full cache's ${bytes(budget.full_bytes)}`
      + (budget.saving ? ` (${budget.saving.toFixed(2)}\u00d7 smaller).` : "."));
    summary.dataset.role = "kv-bytes";
    const legend = el("div", "ex-legend");
    for (const [state, text] of [["full", "full: every key"], ["streamed", "s = streamed: sink + window"],
      ["windowed", "w = windowed by the model"]]) {
      const item = el("span", "", "");
      item.append(el("span", `ex-swatch ex-kv-${state}`), text);
      legend.append(item);
    }
    box.replaceChildren(summary, grid, legend);
    box.dataset.streamed = String(budget.streamed.length);
  }

  function setupGeneration(config) {
    $("gen-model").replaceChildren(...config.models.map((m) => new Option(m.name, m.name)));
    $("gen-tokens").max = String(config.max_new_tokens);
    for (const tab of document.querySelectorAll(".ex-tabs [data-tab]")) {
      tab.addEventListener("click", () => showTab(tab.dataset.tab));
    }
    $("generate-form").addEventListener("submit", (event) => { event.preventDefault(); generate(); });
  }

  // ---- routes and sentences tabs --------------------------------------------------------------
  /* A tab's one request: `ask()` gives the answer, `draw(box, answer)` draws it in the element `boxId`; the server's
   * one line where it refuses (the last drawing is cleared). The box's data-state says busy, done or error. */
  async function runTab(name, boxId, working, ask, draw) {
    const status = $(`${name}-status`);
    const box = $(boxId);
    $(`${name}-run`).disabled = true;
    status.classList.remove("ex-error");
    status.textContent = working;
    box.dataset.state = "busy";
    try {
      const data = await ask();
      await draw(box, data);
      box.dataset.state = "done";
      status.textContent = "";
    } catch (error) {
      box.replaceChildren();
      box.dataset.state = "error";
      status.textContent = error.message;
      status.classList.add("ex-error");
    } finally {
      $(`${name}-run`).disabled = false;
    }
  }

  /* POST /api/routes and draw the route. */
  function route() {
    return runTab("routes", "routes-graph", "routing…", () => {
      const position = $("routes-position").value.trim();
      const tau = $("routes-tau").value.trim();
      return api("/api/routes", { model: $("routes-model").value, text: $("routes-text").value,
        position: position === "" ? -1 : Number(position), tau: tau === "" ? 0.04 : Number(tau) });
    }, (box, data) => Routes.draw(box, data));
  }

  /* POST /api/sentences and draw the sentence panel over the text's tokens. */
  function sentences() {
    return runTab("sentences", "sentences-view", "averaging by sentence…", () => {
      const proximity = $("sentences-proximity").value.trim();
      return api("/api/sentences", { model: $("sentences-model").value, text: $("sentences-text").value,
        proximity: proximity === "" ? 4 : Number(proximity) });
    }, (box, data) => Sentences.render(box, { ...data, title: `${data.model}: sentence-level attention` }));
  }

  function setupTab(name, run) {
    $(`${name}-model`).replaceChildren(...page.config.models.map((m) => new Option(m.name, m.name)));
    $(`${name}-form`).addEventListener("submit", (event) => { event.preventDefault(); run(); });
  }

  // ---- head functions tab --------------------------------------------------------------------
  const headScores = { data: null, score: null }; // the last /api/head-scores answer and the score it is of

  function describeScore() {
    const found = page.config.head_functions.find((f) => f.name === $("hf-score").value);
    $("hf-definition").textContent = found ? `${found.label} (${found.cited}; task: ${found.task.replace(/_/g, " ")}): ` +
      `${found.reference}.` : "";
  }

  function drawHeadGrid() {
    Heads.drawGrid($("hf-grid"), headScores.data, $("hf-column").value, openHeadTrial);
  }

  /* POST /api/head-scores and draw the grid of the score's first column (a menu offers the others). */
  function scoreHeads() {
    const body = { model: $("hf-model").value, score: $("hf-score").value };
    $("hf-trial").replaceChildren();
    return runTab("hf", "hf-grid", "scoring every head\u2026", () => api("/api/head-scores", body), (box, data) => {
      headScores.data = data;
      headScores.score = body.score;
      $("hf-column").replaceChildren(...data.columns.map((name) => new Option(name, name)));
      $("hf-column-field").hidden = data.columns.length < 2;
      drawHeadGrid();
      markLoaded(data.model);
    });
  }

  /* POST /api/head-trial for a clicked head and draw its row on the trial. */
  function openHeadTrial(layer, head) {
    Heads.open($("hf-grid"), layer, head);
    const found = page.config.head_functions.find((f) => f.name === headScores.score);
    if (found && !found.trial) {
      $("hf-trial").replaceChildren(el("p", "ex-note", `no trial view for the ${found.task} task`));
      return undefined;
    }
    const body = { model: headScores.data.model, score: headScores.score, layer, head };
    return runTab("hf", "hf-trial", `layer ${layer}, head ${head}\u2026`, () => api("/api/head-trial", body),
      (box, data) => Heads.drawTrial(box, data));
  }

  function setupHeadFunctions(config) {
    setupTab("hf", scoreHeads);
    $("hf-score").replaceChildren(...config.head_functions.map((f) => {
      const option = new Option(f.label, f.name);
      option.title = `${f.reference} (${f.cited})`;
      return option;
    }));
    $("hf-score").addEventListener("change", describeScore);
    $("hf-column").addEventListener("change", drawHeadGrid);
    describeScore();
  }

  // ---- start -------------------------------------------------------------------------------
  function markLoaded(name) {
    const option = [...$("model").options].find((o) => o.value === name);
    const model = page.config.models.find((m) => m.name === name);
    if (model) model.loaded = true;
    if (option) option.textContent = name;
    describeModel();
  }

  function describeModel() {
    const model = page.config.models.find((m) => m.name === $("model").value);
    $("model-note").textContent = model ? `${model.description}${model.loaded ? "" : " (loads on first use)"}` : "";
  }

  async function start() {
    try {
      page.config = await api("/api/models");
    } catch (error) {
      setStatus(`cannot reach the server: ${error.message}`, true);
      return;
    }
    const config = page.config;
    page.qkHint = [...$("qk-panel").childNodes].map((node) => node.cloneNode(true));
    $("model").replaceChildren(...config.models.map((m) => new Option(m.loaded ? m.name : `${m.name} (not loaded yet)`, m.name)));
    $("model").value = config.default;
    $("mode").replaceChildren(...Object.entries(config.modes).map(([name, text]) => {
      const option = new Option(name, name);
      option.title = text;
      return option;
    }));
    const note = () => { $("mode-note").textContent = config.modes[$("mode").value]; };
    $("mode").addEventListener("change", note);
    $("model").addEventListener("change", describeModel);
    $("input-form").addEventListener("submit", (event) => { event.preventDefault(); analyze(false); });
    $("text").addEventListener("keydown", (event) => {  // Enter writes a new line in the text area; Ctrl+Enter analyses
      if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) { event.preventDefault(); analyze(false); }
    });
    $("add-head").addEventListener("click", addOpenHead);
    $("run-change").addEventListener("click", runChange);
    $("json-link").addEventListener("click", downloadRecord);
    setupGeneration(config);
    setupTab("routes", route);
    setupTab("sentences", sentences);
    setupHeadFunctions(config);
    $("norms").addEventListener("change", () => setNorms($("norms").checked));
    for (const radio of document.querySelectorAll("input[name=showing]")) {
      radio.addEventListener("change", () => showChanged(radio.value));
    }
    const asked = address();
    if (asked.get("model") && config.models.some((m) => m.name === asked.get("model"))) $("model").value = asked.get("model");
    $("text").value = asked.get("text") || "";
    $("pair").value = asked.get("pair") || "";
    if (asked.get("do") && config.modes[asked.get("do")]) $("mode").value = asked.get("do");
    $("change-heads").value = (asked.get("heads") || "").replace(/,/g, ", ");
    $("change-layers").value = (asked.get("layers") || "").replace(/,/g, ", ");
    $("norms").checked = asked.get("norms") === "1";
    note();
    describeModel();
    if (!asked.get("text")) return;
    await analyze(true);
    if (page.analysis && (asked.get("heads") || asked.get("layers"))) {
      if (asked.get("on")) $("kind").value = asked.get("on");
      await runChange();
      if (page.change && asked.get("show") === "changed") showChanged("changed");
    }
  }

  start();
})(window.AttnscopeViews, window.AttnscopeSteps, window.AttnscopeRoutes, window.AttnscopeSentences,
  window.AttnscopeHeadFunctions);
