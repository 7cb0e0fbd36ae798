// What a screenshot of the web demo must show, measured in the page: nothing wider than the viewport, no
// label or value cut off, every control whole, big enough to tap and clear of the others, and where an
// error is on show, that it is inside the visible part of the page. Used by web_demo_check.mjs and
// web_demo_errors.mjs; tests/test_web_demo.py asserts on the reports.

// Runs in the page (page.evaluate): plain data out.
function measureLayout() {
  const viewport = { width: document.documentElement.clientWidth, height: window.innerHeight };
  const shown = (element) => {
    // The contents of a closed <details> are laid out but not displayed (Chromium's content-visibility).
    if (element.closest("details:not([open])") && !element.closest("summary")) return false;
    const box = element.getBoundingClientRect();
    const style = getComputedStyle(element);
    return box.width > 0 && box.height > 0 && style.visibility !== "hidden" && Number(style.opacity) > 0;
  };
  const name = (element) => {
    const text = (element.textContent || element.value || "").trim().replace(/\s+/g, " ").slice(0, 40);
    return `${element.tagName.toLowerCase()}${element.id ? `#${element.id}` : ""}${text ? ` "${text}"` : ""}`;
  };
  const boxOf = (element) => {
    const box = element.getBoundingClientRect();
    return { left: box.left, top: box.top, right: box.right, bottom: box.bottom };
  };

  // Anything sticking out sideways (it would make the page scroll horizontally on a phone).
  const outside = [...document.body.querySelectorAll("*")]
    .filter((element) => shown(element))
    .filter((element) => {
      const box = element.getBoundingClientRect();
      return box.left < -0.5 || box.right > viewport.width + 0.5;
    })
    .map(name);

  // Text cut off by its box (ellipsis or overflow), the sentences of the timing table included.
  const textSelectors = [
    ".topbar .name", ".pill", "h2", ".tag", ".segmented span", ".llm-speed label", ".llm-speed output",
    ".settings label > span", "button", ".card .label", ".card .value", ".sparkline-head span", ".legend span",
    "table.sentences th", "#sentence-rows td", ".notice p", ".clone summary",
  ];
  const clipped = [...document.querySelectorAll(textSelectors.join(","))]
    .filter(shown)
    .filter((element) => element.scrollWidth > element.clientWidth + 0.5 || element.scrollHeight > element.clientHeight + 0.5)
    .map(name);

  // A select shows its chosen option's text: it must fit between the padding and the arrow.
  const canvas = document.createElement("canvas").getContext("2d");
  const selectsCut = [...document.querySelectorAll("select")].filter(shown).flatMap((select) => {
    const style = getComputedStyle(select);
    canvas.font = `${style.fontWeight} ${style.fontSize} ${style.fontFamily}`;
    const text = select.selectedOptions[0]?.textContent ?? "";
    const room = select.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight) - 18; // arrow
    return canvas.measureText(text).width > room ? [`${name(select)} shows "${text}" in ${Math.round(room)} px`] : [];
  });

  // Controls: whole, inside the page's width, at least 32 px tall (the range slider excepted), and not
  // covering one another.
  const controls = [...document.querySelectorAll("button, select, textarea, input:not([type=radio]), .segmented span")].filter(shown);
  const small = controls
    .filter((element) => element.type !== "range")
    .filter((element) => element.getBoundingClientRect().height < 32 - 0.5 && !element.matches(".segmented span"))
    .map(name);
  const overlapping = [];
  for (let i = 0; i < controls.length; i++) {
    for (let j = i + 1; j < controls.length; j++) {
      const a = controls[i].getBoundingClientRect();
      const b = controls[j].getBoundingClientRect();
      const overlap = Math.min(a.right, b.right) - Math.max(a.left, b.left) > 0.5 && Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top) > 0.5;
      if (overlap) overlapping.push(`${name(controls[i])} / ${name(controls[j])}`);
    }
  }

  const notice = document.getElementById("notice");
  const noticeBox = notice && shown(notice) ? boxOf(notice) : null;
  return {
    viewport,
    scrollWidth: document.documentElement.scrollWidth,
    outside,
    clipped,
    selectsCut,
    small,
    overlapping,
    controls: controls.length,
    notice: noticeBox && {
      box: noticeBox,
      // Entirely inside the visible part of the page (the user sees it without scrolling).
      inView: noticeBox.top >= 0 && noticeBox.left >= 0 && noticeBox.bottom <= viewport.height && noticeBox.right <= viewport.width,
      text: document.getElementById("notice-text").textContent,
      color: getComputedStyle(notice).backgroundColor,
    },
    focused: document.activeElement?.id || null,
  };
}

/** Resize the page, let it lay out and draw, and measure it; then save a full-page screenshot. */
export async function checkLayout(page, { width, height, screenshot }) {
  await page.setViewportSize({ width, height });
  // Two animation frames: the resize has been laid out and the canvases redrawn at the new width.
  await page.evaluate(() => new Promise((resolve) => requestAnimationFrame(() => requestAnimationFrame(resolve))));
  const report = await page.evaluate(measureLayout);
  await page.screenshot({ path: screenshot, fullPage: true });
  return { ...report, screenshot };
}

/** Measure without resizing (the notice's position as the user left it) and save a screenshot of the viewport. */
export async function checkView(page, { screenshot }) {
  await page.evaluate(() => new Promise((resolve) => requestAnimationFrame(() => requestAnimationFrame(resolve))));
  const report = await page.evaluate(measureLayout);
  await page.screenshot({ path: screenshot });
  return { ...report, screenshot };
}
