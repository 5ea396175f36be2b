/* attnscope views: a scene is the list of drawing commands of one view.
 *
 * Views only describe what to draw (rectangles, batches of lines, text, small images). The same
 * scene is painted on a canvas (fast enough for 512 tokens x 144 heads) and serialised to SVG for
 * export, so the exported picture is exactly what is on screen.
 */
(function (NS) {
  "use strict";

  const element = NS.element;  // decode.js

  const FONT = "Helvetica, Arial, sans-serif";
  // one colour per head; heads past the 12th get colours spread around the hue circle
  const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
    "#e377c2", "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#ad494a"];
  const POSITIVE = [31, 119, 180]; // blue: positive values in the neuron view
  const NEGATIVE = [255, 127, 14]; // orange: negative values

  function headColor(head) {
    if (head < PALETTE.length) return PALETTE[head];
    return `hsl(${Math.round((head * 137.508) % 360)}, 62%, 45%)`;
  }

  function rgbOf(color) {
    const probe = document.createElement("canvas").getContext("2d");
    probe.fillStyle = color;
    const hex = probe.fillStyle; // normalised to #rrggbb
    return [1, 3, 5].map((i) => parseInt(hex.slice(i, i + 2), 16));
  }

  class Scene {
    constructor(width, height) {
      this.width = width;
      this.height = height;
      this.items = [];
    }
    rect(x, y, w, h, style) {
      this.items.push({ type: "rect", x, y, w, h, style });
    }
    /* coords: [x1, y1, x2, y2, ...]; meta: anything views want to read back (one entry per segment). */
    lines(coords, style, meta) {
      if (coords.length) this.items.push({ type: "lines", coords, style, meta });
    }
    text(x, y, text, style, meta) {
      this.items.push({ type: "text", x, y, text: String(text), style: style || {}, meta });
    }
    /* pixels: {width, height, data: Uint8ClampedArray RGBA}, drawn scaled to w x h without smoothing. */
    image(x, y, w, h, pixels, meta) {
      this.items.push({ type: "image", x, y, w, h, pixels, meta });
    }
    ofType(type) {
      return this.items.filter((item) => item.type === type);
    }
  }

  function font(style) {
    return `${style.weight || "normal"} ${style.size || 12}px ${FONT}`;
  }

  function pixelCanvas(item) {
    if (!item.canvas) {
      item.canvas = document.createElement("canvas");
      item.canvas.width = item.pixels.width;
      item.canvas.height = item.pixels.height;
      const image = new ImageData(item.pixels.data, item.pixels.width, item.pixels.height);
      item.canvas.getContext("2d").putImageData(image, 0, 0);
    }
    return item.canvas;
  }

  /* Painters skip what lies outside `view` (a rectangle in scene coordinates): a long input's
   * head view is thousands of pixels tall, and only the part in sight is painted. */
  const outside = (top, bottom, view) => bottom < view.y || top > view.y + view.h;

  const painters = {
    rect(ctx, item, view) {
      if (outside(item.y, item.y + item.h, view)) return;
      const s = item.style;
      ctx.globalAlpha = s.alpha === undefined ? 1 : s.alpha;
      if (s.fill) {
        ctx.fillStyle = s.fill;
        ctx.fillRect(item.x, item.y, item.w, item.h);
      }
      if (s.stroke) {
        ctx.strokeStyle = s.stroke;
        ctx.lineWidth = s.lineWidth || 1;
        ctx.strokeRect(item.x, item.y, item.w, item.h);
      }
    },
    lines(ctx, item, view) {
      const c = item.coords;
      ctx.globalAlpha = item.style.alpha;
      ctx.strokeStyle = item.style.color;
      ctx.lineWidth = item.style.width || 1;
      ctx.beginPath();
      let open = 0;
      for (let i = 0; i < c.length; i += 4) {
        if (outside(Math.min(c[i + 1], c[i + 3]), Math.max(c[i + 1], c[i + 3]), view)) continue;
        ctx.moveTo(c[i], c[i + 1]);
        ctx.lineTo(c[i + 2], c[i + 3]);
        // short paths: one huge self-crossing path rasterizes far slower than many small ones
        if (++open === 64) { ctx.stroke(); ctx.beginPath(); open = 0; }
      }
      if (open) ctx.stroke();
    },
    text(ctx, item, view) {
      if (outside(item.y - 20, item.y + 20, view)) return;
      const s = item.style;
      ctx.globalAlpha = s.alpha === undefined ? 1 : s.alpha;
      ctx.font = font(s);
      ctx.fillStyle = s.color || "#222";
      ctx.textAlign = s.align || "left";
      ctx.textBaseline = "middle";
      if (!s.rotate) {
        ctx.fillText(item.text, item.x, item.y);
        return;
      }
      ctx.save(); // rotated text (the long view's key labels): turn about the text's anchor
      ctx.translate(item.x, item.y);
      ctx.rotate((s.rotate * Math.PI) / 180);
      ctx.fillText(item.text, 0, 0);
      ctx.restore();
    },
    image(ctx, item, view) {
      if (outside(item.y, item.y + item.h, view)) return;
      ctx.globalAlpha = 1;
      ctx.imageSmoothingEnabled = false;
      ctx.drawImage(pixelCanvas(item), item.x, item.y, item.w, item.h);
    },
  };

  const CANVAS_LIMIT = 32000; // browsers refuse taller canvases

  /* Paint the part `view` ({x, y, w, h}; default: all) of the scene on `canvas`, at `ratio`
   * device pixels per CSS pixel (lowered if the canvas would be too big). */
  function paint(scene, canvas, ratio, view) {
    const part = view || { x: 0, y: 0, w: scene.width, h: scene.height };
    const scale = Math.min(ratio || window.devicePixelRatio || 1, CANVAS_LIMIT / Math.max(part.w, part.h, 1));
    canvas.width = Math.max(1, Math.ceil(part.w * scale));
    canvas.height = Math.max(1, Math.ceil(part.h * scale));
    canvas.style.width = `${part.w}px`;
    canvas.style.height = `${part.h}px`;
    const ctx = canvas.getContext("2d");
    ctx.setTransform(scale, 0, 0, scale, -part.x * scale, -part.y * scale);
    ctx.globalAlpha = 1;
    ctx.fillStyle = "#ffffff";
    ctx.fillRect(part.x, part.y, part.w, part.h);
    for (const item of scene.items) painters[item.type](ctx, item, part);
    ctx.globalAlpha = 1;
    return canvas;
  }

  /* A scrolling box that shows a scene: the canvas is only as big as the box and is repainted
   * with the part in sight when the box scrolls (a sizer element gives the scene's full size). */
  class Surface {
    constructor(wrap, role) {
      this.wrap = wrap;
      this.scene = null;
      this.sizer = element("div", "as-sizer");
      this.canvas = element("canvas", "as-canvas");
      this.canvas.dataset.role = role;
      wrap.append(this.sizer, this.canvas);
      this.pending = false;
      wrap.addEventListener("scroll", () => {
        if (this.pending) return;
        this.pending = true;
        requestAnimationFrame(() => { this.pending = false; this.repaint(); });
      });
    }
    show(scene) {
      this.scene = scene;
      this.sizer.style.width = `${scene.width}px`;
      this.sizer.style.height = `${scene.height}px`;
      this.repaint();
    }
    repaint() {
      if (!this.scene) return;
      const scene = this.scene;
      const x = Math.min(this.wrap.scrollLeft, scene.width);
      const y = Math.min(this.wrap.scrollTop, scene.height);
      const w = Math.min(scene.width - x, this.wrap.clientWidth || scene.width);
      const h = Math.min(scene.height - y, this.wrap.clientHeight || scene.height);
      this.canvas.style.left = `${x}px`;
      this.canvas.style.top = `${y}px`;
      paint(scene, this.canvas, undefined, { x, y, w, h });
    }
    /* Scene coordinates of a mouse event. */
    at(event) {
      const box = this.wrap.getBoundingClientRect();
      return { x: event.clientX - box.left - this.wrap.clientLeft + this.wrap.scrollLeft,
        y: event.clientY - box.top - this.wrap.clientTop + this.wrap.scrollTop };
    }
    /* Viewport coordinates of a scene point (for tests). */
    point(x, y) {
      const box = this.wrap.getBoundingClientRect();
      return { x: box.left + this.wrap.clientLeft + x - this.wrap.scrollLeft, y: box.top + this.wrap.clientTop + y - this.wrap.scrollTop };
    }
  }

  function escapeXml(text) {
    return text.replace(/[&<>"']/g, (ch) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&apos;" })[ch]);
  }

  const round = (v) => Math.round(v * 10) / 10;
  const ANCHOR = { left: "start", center: "middle", right: "end" };

  const svgWriters = {
    rect(item) {
      const s = item.style;
      const fill = s.fill ? `fill="${s.fill}"` : 'fill="none"';
      const stroke = s.stroke ? ` stroke="${s.stroke}" stroke-width="${s.lineWidth || 1}"` : "";
      const alpha = s.alpha === undefined ? "" : ` opacity="${round(s.alpha * 1000) / 1000}"`;
      return `<rect x="${round(item.x)}" y="${round(item.y)}" width="${round(item.w)}" height="${round(item.h)}" ${fill}${stroke}${alpha}/>`;
    },
    lines(item) {
      const c = item.coords;
      const parts = [];
      for (let i = 0; i < c.length; i += 4) parts.push(`M${round(c[i])} ${round(c[i + 1])}L${round(c[i + 2])} ${round(c[i + 3])}`);
      const s = item.style;
      return `<path d="${parts.join("")}" fill="none" stroke="${s.color}" stroke-width="${s.width || 1}" stroke-opacity="${round(s.alpha * 1000) / 1000}"/>`;
    },
    text(item) {
      const s = item.style;
      const alpha = s.alpha === undefined ? "" : ` opacity="${s.alpha}"`;
      const turn = s.rotate ? ` transform="rotate(${s.rotate} ${round(item.x)} ${round(item.y)})"` : "";
      return `<text${turn} x="${round(item.x)}" y="${round(item.y)}" font-family="${FONT}" font-size="${s.size || 12}" ` +
        `font-weight="${s.weight || "normal"}" fill="${s.color || "#222"}" text-anchor="${ANCHOR[s.align || "left"]}" ` +
        `dominant-baseline="central"${alpha}>${escapeXml(item.text)}</text>`;
    },
    image(item) {
      const href = pixelCanvas(item).toDataURL("image/png");
      return `<image x="${round(item.x)}" y="${round(item.y)}" width="${round(item.w)}" height="${round(item.h)}" ` +
        `preserveAspectRatio="none" style="image-rendering:pixelated" href="${href}"/>`;
    },
  };

  function toSVG(scene) {
    const body = scene.items.map((item) => svgWriters[item.type](item)).join("\n");
    return `<svg xmlns="http://www.w3.org/2000/svg" width="${scene.width}" height="${scene.height}" ` +
      `viewBox="0 0 ${scene.width} ${scene.height}">\n<rect width="100%" height="100%" fill="#ffffff"/>\n${body}\n</svg>\n`;
  }

  let measurer = null;
  function textWidth(text, size, weight) {
    measurer = measurer || document.createElement("canvas").getContext("2d");
    measurer.font = font({ size, weight });
    return measurer.measureText(text).width;
  }

  /* Token text for display: at most `max` characters, whitespace made visible. */
  function label(token, max) {
    const shown = token.replace(/\n/g, "\\n").replace(/\t/g, "\\t");
    const visible = shown.trim() === "" ? `\u2423${shown.length > 1 ? shown.length : ""}` : shown;
    return visible.length > max ? `${visible.slice(0, max - 1)}\u2026` : visible;
  }

  /* Colour strip cell: blue for positive, orange for negative, opacity = |value| / largest. */
  function signedColor(value, largest) {
    const [r, g, b] = value >= 0 ? POSITIVE : NEGATIVE;
    const alpha = largest > 0 ? Math.min(1, Math.abs(value) / largest) : 0;
    return { fill: `rgb(${r},${g},${b})`, alpha };
  }

  /* A named colour scale: `steps` = [{fill, alpha}] drawn left to right as one bar, `ends` = [left,
   * right] labels beside it (and `middle` under its centre, if given), then `name`. Its text items
   * carry meta {role: "scale"} so tests and tools can read what the colours mean. */
  function colorScale(scene, x, y, steps, ends, name, middle) {
    const cell = 10;
    const size = 11;
    const leftWidth = textWidth(ends[0], size);
    scene.text(x, y, ends[0], { size, color: "#555" }, { role: "scale" });
    const start = x + leftWidth + 4;
    steps.forEach((step, i) => scene.rect(start + i * cell, y - 5, cell, 10, { fill: step.fill, alpha: step.alpha }));
    scene.rect(start - 0.5, y - 5.5, steps.length * cell + 1, 11, { stroke: "#ccc", lineWidth: 1 });
    const end = start + steps.length * cell + 4;
    scene.text(end, y, ends[1], { size, color: "#555" }, { role: "scale" });
    if (middle) scene.text(start + (steps.length * cell) / 2, y + 12, middle, { size: 9, color: "#888", align: "center" });
    scene.text(end + textWidth(ends[1], size) + 10, y, name, { size, color: "#555" }, { role: "scale" });
  }

  /* The neuron view's scale: orange negative, white at 0, blue positive, opacity = |value| / largest. */
  function signedScale(scene, x, y) {
    const steps = [];
    for (let i = -5; i <= 5; i++) steps.push(signedColor(i, 5));
    colorScale(scene, x, y, steps, ["negative (orange)", "positive (blue)"],
      "opacity = |value| / the largest |value| in its column", "0");
  }

  /* A form control with its label: control(kind, text, role) -> [label, input]; kind is
   * "select" (text before it) or "checkbox" (text after it); role names it for tests (data-role). */
  function control(kind, text, role) {
    const label = element("label", "as-control");
    const input = element(kind === "select" ? "select" : "input");
    if (kind === "checkbox") input.type = "checkbox";
    input.dataset.role = role;
    if (kind === "select") label.append(`${text} `, input); else label.append(input, ` ${text}`);
    return [label, input];
  }

  /* A row of tab buttons: views = [[name, text], ...] (data-view=name); click calls choose(name). */
  function tabs(views, choose) {
    const row = element("div", "as-tabs");
    for (const [name, text] of views) {
      const tab = element("button", "as-tab", text);
      tab.type = "button";
      tab.dataset.view = name;
      tab.addEventListener("click", () => choose(name));
      row.append(tab);
    }
    return row;
  }

  Object.assign(NS, { control, tabs, Scene, Surface, paint, toSVG, headColor, rgbOf, textWidth, label, signedColor,
    colorScale, signedScale, FONT });
})((window.AttnscopeViews = window.AttnscopeViews || {}));
