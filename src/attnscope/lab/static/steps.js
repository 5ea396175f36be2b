/* attnscope step view: one row per decoding step of an encoder-decoder (prefix, top candidates,
 * the newest decoder position's cross-attention over the source).
 *
 * AttnscopeSteps.render(container, trace) fills `container`; `trace` is DecodeTrace.to_payload():
 * {source, source_tokens, output, method, steps: [{index, prefix, candidates, chosen,
 *  cross_attention [layer][head][source_pos], cross_attention_mean [source_pos]}]}.
 * Used by the standalone page (DecodeTrace.save_html) and by the explorer (attnscope serve).
 */
(function (NS) {
  "use strict";

  const el = (tag, cls, text) => {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  };

  function candidateCell(step) {
    const cell = el("td");
    for (const c of step.candidates) {
      const line = el("div", "st-cand" + (c.token === step.chosen ? " st-chosen" : ""));
      const bar = el("span", "st-bar");
      bar.style.width = Math.round(80 * c.probability) + "px";
      line.append(bar, el("span", "", `${c.token} ${c.probability.toFixed(2)} (logit ${c.logit.toFixed(1)})`));
      cell.append(line);
    }
    return cell;
  }

  function heatCell(tokens, weights) {
    const cell = el("td");
    const strip = el("div", "st-heat");
    const top = Math.max(...weights, 1e-9);
    tokens.forEach((token, i) => {
      const piece = el("span", "st-cell", token);
      const shade = weights[i] / top;  // darkest = the most attended source token of this step
      piece.style.background = `rgba(200, 70, 30, ${shade.toFixed(3)})`;
      piece.style.color = shade > 0.55 ? "white" : "#222";
      piece.title = `${token}: ${weights[i].toFixed(3)}`;
      strip.append(piece);
    });
    cell.append(strip);
    return cell;
  }

  NS.render = function render(container, trace) {
    const which = el("select");
    which.dataset.role = "steps-attention";
    which.append(new Option("mean of all layers and heads", "mean"));
    const first = trace.steps.length ? trace.steps[0].cross_attention : [];
    first.forEach((heads, layer) => heads.forEach((_, head) =>
      which.append(new Option(`layer ${layer}, head ${head}`, `${layer}/${head}`))));
    const controls = el("div", "st-controls", "cross-attention shown: ");
    controls.append(which, el("span", "st-note",
      " layers and heads are 0-indexed; darker = more attention of the newest decoder position"));
    const table = el("table", "st-table");
    const head = el("tr");
    for (const name of ["step", "prefix", "top next tokens (probability)", "cross-attention over the source"]) head.append(el("th", "", name));
    const body = el("tbody");
    table.append(el("thead"), body);
    table.tHead.append(head);
    const weights = (step) => {
      if (which.value === "mean") return step.cross_attention_mean;
      const [layer, h] = which.value.split("/").map(Number);
      return step.cross_attention[layer][h];
    };
    const draw = () => {
      body.replaceChildren(...trace.steps.map((step) => {
        const row = el("tr");
        row.append(el("td", "", String(step.index)), el("td", "st-prefix", step.prefix.join(" ")),
          candidateCell(step), heatCell(trace.source_tokens, weights(step)));
        return row;
      }));
    };
    which.addEventListener("change", draw);
    container.replaceChildren(el("h3", "st-title", `${trace.method} decoding of: ${trace.source}`), controls, table,
      el("p", "st-output", `output: ${trace.output}`));
    container.classList.add("attnscope-steps");
    draw();
  };
})((window.AttnscopeSteps = window.AttnscopeSteps || {}));
