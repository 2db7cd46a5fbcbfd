"""Generate the bundled SFT and DPO sample data (deterministic, fixed seed).

Writes:
  data/sft/sft_instructions.jsonl   {"instruction", "input", "output"}
  data/sft/sft_conversations.jsonl  {"conversations": [{"role","content"}...]}  or
                                    ShareGPT spelling [{"from","value"}...]
  data/dpo/dpo_pairs.jsonl          {"prompt","chosen","rejected"}  or
                                    {"conversations": [...prior turns...], "chosen", "rejected"}

All tasks are simple and checkable (arithmetic, unit conversion, capitals, word
reversal, letter counting, a small EN<->ZH glossary, greetings) plus a set of
hand-written samples. Written for this project; MIT licence.

Usage: python data/tools/make_sft_dpo.py
"""
import json
import os
import random

SEED = 20240601
HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.normpath(os.path.join(HERE, ".."))

CAPITALS = [  # (country_en, capital_en, country_zh, capital_zh)
    ("France", "Paris", "法国", "巴黎"), ("Germany", "Berlin", "德国", "柏林"),
    ("Italy", "Rome", "意大利", "罗马"), ("Spain", "Madrid", "西班牙", "马德里"),
    ("Portugal", "Lisbon", "葡萄牙", "里斯本"), ("Japan", "Tokyo", "日本", "东京"),
    ("China", "Beijing", "中国", "北京"), ("Egypt", "Cairo", "埃及", "开罗"),
    ("Kenya", "Nairobi", "肯尼亚", "内罗毕"), ("Canada", "Ottawa", "加拿大", "渥太华"),
    ("Australia", "Canberra", "澳大利亚", "堪培拉"), ("Brazil", "Brasilia", "巴西", "巴西利亚"),
    ("Argentina", "Buenos Aires", "阿根廷", "布宜诺斯艾利斯"), ("Mexico", "Mexico City", "墨西哥", "墨西哥城"),
    ("Russia", "Moscow", "俄罗斯", "莫斯科"), ("India", "New Delhi", "印度", "新德里"),
    ("South Korea", "Seoul", "韩国", "首尔"), ("Thailand", "Bangkok", "泰国", "曼谷"),
    ("Vietnam", "Hanoi", "越南", "河内"), ("Indonesia", "Jakarta", "印度尼西亚", "雅加达"),
    ("Turkey", "Ankara", "土耳其", "安卡拉"), ("Greece", "Athens", "希腊", "雅典"),
    ("Norway", "Oslo", "挪威", "奥斯陆"), ("Sweden", "Stockholm", "瑞典", "斯德哥尔摩"),
    ("Finland", "Helsinki", "芬兰", "赫尔辛基"), ("Poland", "Warsaw", "波兰", "华沙"),
    ("Austria", "Vienna", "奥地利", "维也纳"), ("Netherlands", "Amsterdam", "荷兰", "阿姆斯特丹"),
    ("Ireland", "Dublin", "爱尔兰", "都柏林"), ("Peru", "Lima", "秘鲁", "利马"),
    ("Chile", "Santiago", "智利", "圣地亚哥"), ("New Zealand", "Wellington", "新西兰", "惠灵顿"),
    ("Switzerland", "Bern", "瑞士", "伯尔尼"), ("Hungary", "Budapest", "匈牙利", "布达佩斯"),
    ("Denmark", "Copenhagen", "丹麦", "哥本哈根"), ("Morocco", "Rabat", "摩洛哥", "拉巴特"),
]

GLOSSARY = [  # (english, chinese)
    ("apple", "苹果"), ("book", "书"), ("water", "水"), ("computer", "电脑"),
    ("teacher", "老师"), ("friend", "朋友"), ("river", "河流"), ("mountain", "山"),
    ("rain", "雨"), ("sun", "太阳"), ("moon", "月亮"), ("school", "学校"),
    ("hospital", "医院"), ("train", "火车"), ("flower", "花"), ("bread", "面包"),
    ("cat", "猫"), ("dog", "狗"), ("library", "图书馆"), ("music", "音乐"),
    ("window", "窗户"), ("kitchen", "厨房"), ("doctor", "医生"), ("city", "城市"),
    ("tea", "茶"), ("rice", "米饭"), ("tree", "树"), ("bird", "鸟"),
    ("morning", "早上"), ("weather", "天气"),
]

WORDS = ["python", "banana", "library", "keyboard", "window", "elephant", "mountain",
         "orange", "rabbit", "summer", "network", "teacher", "garden", "pencil",
         "bicycle", "coffee", "history", "planet", "silver", "tomato", "yellow",
         "kitten", "balloon", "dragon", "marble", "letter", "butter", "travel",
         "strawberry", "committee", "mississippi", "assessment", "bookkeeper"]

UNITS = [  # (from_en, to_en, from_zh, to_zh, factor)
    ("kilometers", "meters", "千米", "米", 1000), ("meters", "centimeters", "米", "厘米", 100),
    ("kilograms", "grams", "千克", "克", 1000), ("hours", "minutes", "小时", "分钟", 60),
    ("minutes", "seconds", "分钟", "秒", 60), ("liters", "milliliters", "升", "毫升", 1000),
    ("days", "hours", "天", "小时", 24), ("weeks", "days", "周", "天", 7),
]

GREETINGS_EN = [
    ("Hello!", "Hello! How can I help you today?"),
    ("Good morning!", "Good morning! I hope your day is off to a great start. What can I do for you?"),
    ("Hi, how are you?", "I'm doing well, thank you for asking! How are you, and what can I help you with?"),
    ("Thank you for your help.", "You're very welcome! Feel free to ask if you need anything else."),
    ("Goodbye!", "Goodbye! Have a wonderful day."),
    ("Good evening.", "Good evening! What would you like to talk about?"),
    ("Thanks a lot!", "You're welcome! I'm glad I could help."),
    ("Nice to meet you.", "Nice to meet you too! How can I assist you?"),
]
GREETINGS_ZH = [
    ("你好！", "你好！有什么可以帮你的吗？"),
    ("早上好！", "早上好！祝你今天一切顺利。有什么需要我帮忙的吗？"),
    ("谢谢你的帮助。", "不客气！如果还有其他问题，随时可以问我。"),
    ("再见！", "再见！祝你生活愉快。"),
    ("晚上好。", "晚上好！今天想聊些什么呢？"),
    ("你好吗？", "我很好，谢谢关心！你呢？有什么我可以帮你的吗？"),
    ("辛苦了，谢谢！", "不客气，很高兴能帮上忙！"),
    ("很高兴认识你。", "我也很高兴认识你！有什么问题都可以问我。"),
]
RUDE_EN = ["Whatever.", "Figure it out yourself.", "I don't care.", "Stop bothering me."]
RUDE_ZH = ["随便。", "自己想去。", "关我什么事。", "别烦我。"]

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a concise and accurate assistant.",
    "你是一个乐于助人的助手。",
    "你是一个回答简洁、准确的中文助手。",
]


# ---------------------------------------------------------------- task makers
# Each returns (lang, prompt, correct_answer, wrong_answer).

def t_arith(r):
    op = r.choice("+-*")
    a, b = r.randint(2, 99), r.randint(2, 99)
    if op == "-" and b > a:
        a, b = b, a
    res = a + b if op == "+" else a - b if op == "-" else a * b
    wrong = res + r.choice([-10, -2, -1, 1, 2, 10])
    sym = {"+": "+", "-": "-", "*": "×"}[op]
    if r.random() < 0.5:
        word = {"+": "plus", "-": "minus", "*": "times"}[op]
        q = r.choice([f"What is {a} {word} {b}?", f"Calculate {a} {sym} {b}.", f"Compute {a} {sym} {b}."])
        return "en", q, f"{a} {sym} {b} = {res}.", f"{a} {sym} {b} = {wrong}."
    word = {"+": "加", "-": "减", "*": "乘以"}[op]
    q = r.choice([f"{a}{word}{b}等于多少？", f"请计算 {a} {sym} {b}。", f"{a} {sym} {b} 是多少？"])
    return "zh", q, f"{a} {sym} {b} = {res}。", f"{a} {sym} {b} = {wrong}。"


def t_unit(r):
    fe, te, fz, tz, k = r.choice(UNITS)
    n = r.randint(2, 30)
    wrong = n * k + r.choice([-k // 2, k // 2, k]) if k > 10 else n * k + r.choice([-1, 1, k])
    if r.random() < 0.5:
        return ("en", f"Convert {n} {fe} to {te}.",
                f"{n} {fe} is {n * k} {te}, because 1 {fe[:-1]} = {k} {te}.",
                f"{n} {fe} is {wrong} {te}.")
    return ("zh", f"{n}{fz}等于多少{tz}？",
            f"{n}{fz}等于{n * k}{tz}，因为1{fz}等于{k}{tz}。",
            f"{n}{fz}等于{wrong}{tz}。")


def t_capital(r):
    i = r.randrange(len(CAPITALS))
    ce, ke, cz, kz = CAPITALS[i]
    j = (i + r.randint(1, len(CAPITALS) - 1)) % len(CAPITALS)
    _, we, _, wz = CAPITALS[j]
    if r.random() < 0.5:
        q = r.choice([f"What is the capital of {ce}?", f"Which city is the capital of {ce}?"])
        return "en", q, f"The capital of {ce} is {ke}.", f"The capital of {ce} is {we}."
    q = r.choice([f"{cz}的首都是哪里？", f"{cz}的首都是哪座城市？"])
    return "zh", q, f"{cz}的首都是{kz}。", f"{cz}的首都是{wz}。"


def t_reverse(r):
    w = r.choice(WORDS)
    rev = w[::-1]
    wrong = rev[1:] + rev[0] if len(set(w)) > 1 else rev + "x"
    if wrong == rev:
        wrong = rev[:-1]
    if r.random() < 0.5:
        return "en", f'Reverse the word "{w}".', f'The reversed word is "{rev}".', f'The reversed word is "{wrong}".'
    return "zh", f"请把单词“{w}”倒过来写。", f"倒过来写是“{rev}”。", f"倒过来写是“{wrong}”。"


def t_count(r):
    w = r.choice(WORDS)
    ch = r.choice(sorted(set(w)))
    c = w.count(ch)
    wrong = c + r.choice([1, 2]) if c == 1 else c + r.choice([-1, 1])
    if r.random() < 0.5:
        return ("en", f'How many times does the letter "{ch}" appear in "{w}"?',
                f'The letter "{ch}" appears {c} time{"s" if c != 1 else ""} in "{w}".',
                f'The letter "{ch}" appears {wrong} times in "{w}".')
    return ("zh", f"单词“{w}”中字母“{ch}”出现了几次？",
            f"字母“{ch}”在“{w}”中出现了{c}次。", f"字母“{ch}”在“{w}”中出现了{wrong}次。")


def t_translate(r):
    i = r.randrange(len(GLOSSARY))
    en, zh = GLOSSARY[i]
    wen, wzh = GLOSSARY[(i + r.randint(1, len(GLOSSARY) - 1)) % len(GLOSSARY)]
    if r.random() < 0.5:
        return "en", f'Translate the English word "{en}" into Chinese.', f'"{en}" in Chinese is "{zh}".', f'"{en}" in Chinese is "{wzh}".'
    return "zh", f"“{zh}”用英语怎么说？", f"“{zh}”的英文是“{en}”。", f"“{zh}”的英文是“{wen}”。"


def t_greet(r):
    if r.random() < 0.5:
        q, a = r.choice(GREETINGS_EN)
        return "en", q, a, r.choice(RUDE_EN)
    q, a = r.choice(GREETINGS_ZH)
    return "zh", q, a, r.choice(RUDE_ZH)


def t_compare(r):
    a, b = r.sample(range(1, 1000), 2)
    big, small = max(a, b), min(a, b)
    if r.random() < 0.5:
        return "en", f"Which number is larger, {a} or {b}?", f"{big} is larger than {small}.", f"{small} is larger than {big}."
    return "zh", f"{a}和{b}哪个更大？", f"{big}比{small}大。", f"{small}比{big}大。"


def t_sort(r):
    xs = r.sample(range(1, 100), r.randint(4, 7))
    s = sorted(xs)
    wrong = s[:]
    k = r.randrange(len(wrong) - 1)
    wrong[k], wrong[k + 1] = wrong[k + 1], wrong[k]
    fmt = lambda v: ", ".join(map(str, v))
    if r.random() < 0.5:
        return "en", f"Sort these numbers in ascending order: {fmt(xs)}", f"In ascending order: {fmt(s)}.", f"In ascending order: {fmt(wrong)}."
    return "zh", f"请把这些数字从小到大排序：{fmt(xs)}", f"从小到大排列为：{fmt(s)}。", f"从小到大排列为：{fmt(wrong)}。"


def t_parity(r):
    n = r.randint(1, 9999)
    ev = n % 2 == 0
    if r.random() < 0.5:
        c = f"{n} is {'even' if ev else 'odd'}, because it {'is' if ev else 'is not'} divisible by 2."
        w = f"{n} is {'odd' if ev else 'even'}."
        return "en", f"Is {n} even or odd?", c, w
    c = f"{n}是{'偶数' if ev else '奇数'}，因为它{'能' if ev else '不能'}被2整除。"
    w = f"{n}是{'奇数' if ev else '偶数'}。"
    return "zh", f"{n}是奇数还是偶数？", c, w


TASKS = [t_arith, t_unit, t_capital, t_reverse, t_count, t_translate, t_greet, t_compare, t_sort, t_parity]

# ------------------------------------------------------------- hand-written SFT
HAND_INSTR = [
    ("Explain what a list is in Python in two sentences.", "",
     "A list in Python is an ordered, mutable collection that can hold items of any type, written with square brackets like [1, 2, 3]. You can add, remove and change elements, and access them by their zero-based index."),
    ("用一句话解释什么是光合作用。", "",
     "光合作用是绿色植物利用光能，把二氧化碳和水转化为有机物并释放氧气的过程。"),
    ("Summarize the text in one sentence.", "The city council met on Monday and voted to extend the opening hours of the public library to 9 pm on weekdays, starting next month, after many residents asked for more evening study space.",
     "The city council voted to keep the public library open until 9 pm on weekdays from next month, responding to residents' requests for evening study space."),
    ("把下面的句子改写得更礼貌一些。", "把文件马上发给我。",
     "麻烦您方便的时候尽快把文件发给我，谢谢！"),
    ("Write a Python function that returns the sum of the squares of a list of numbers.", "",
     "def sum_of_squares(numbers):\n    return sum(x * x for x in numbers)\n\n# Example: sum_of_squares([1, 2, 3]) returns 14."),
    ("请给出三条保护视力的建议。", "",
     "1. 连续看屏幕或读书四十分钟左右，休息一下，远眺几分钟。\n2. 保持合适的阅读距离和充足、柔和的光线，不要在昏暗或晃动的环境中看书。\n3. 多参加户外活动，定期检查视力，出现视物模糊时及时就医。"),
    ("Classify the sentiment of the review as positive or negative.", "The battery dies within two hours and the screen scratches easily. Not worth the money.",
     "Negative."),
    ("判断下面这句话的情感是正面还是负面。", "这家餐厅的菜很新鲜，服务员也非常热情，下次还会再来。",
     "正面。"),
    ("Give a short definition of photosynthesis suitable for a 10-year-old.", "",
     "Photosynthesis is how plants make their own food: they use sunlight, water and air (carbon dioxide) to make sugar, and they give off the oxygen we breathe."),
    ("解释一下什么是过拟合，并给出一个避免过拟合的方法。", "",
     "过拟合是指模型把训练数据中的噪声和偶然特征也当成了规律，导致在训练集上表现很好、在新数据上表现变差。一个常用的避免方法是提前停止：在验证集损失不再下降时停止训练。"),
    ("Fix the bug in this Python code.", "def average(xs):\n    return sum(xs) / len(xs) + 1",
     "The function adds 1 to the result by mistake. Corrected version:\n\ndef average(xs):\n    if not xs:\n        raise ValueError(\"average() of an empty list\")\n    return sum(xs) / len(xs)"),
    ("写一首关于春天的四行短诗。", "",
     "细雨轻轻润新芽，\n燕子归来绕人家。\n东风一夜吹绿柳，\n满城都是桃杏花。"),
    ("List three renewable energy sources.", "",
     "1. Solar energy\n2. Wind energy\n3. Hydropower"),
    ("把下面的英文翻译成中文。", "Knowledge is power.",
     "知识就是力量。"),
    ("Translate the following sentence into English.", "我每天早上七点起床。",
     "I get up at seven o'clock every morning."),
    ("请解释 HTTP 状态码 404 的含义。", "",
     "404 表示“未找到”（Not Found）：服务器无法找到客户端请求的资源，通常是网址写错了或者资源已被删除。"),
    ("What is the difference between a process and a thread?", "",
     "A process is an independent program in execution with its own memory space. A thread is a unit of execution inside a process; threads of the same process share its memory, so they are cheaper to create but need care (locks) when accessing shared data."),
    ("给出一个用 Python 读取 JSONL 文件的例子。", "",
     "import json\n\nwith open(\"data.jsonl\", encoding=\"utf-8\") as f:\n    records = [json.loads(line) for line in f if line.strip()]\n\nprint(len(records))"),
    ("Rewrite the sentence in the passive voice.", "The chef cooked a delicious meal.",
     "A delicious meal was cooked by the chef."),
    ("请列出做番茄炒蛋需要的主要食材。", "",
     "主要食材有：番茄、鸡蛋、葱，以及盐、白糖和食用油等调料。"),
]

HAND_CONV = [
    [("system", "You are a helpful assistant."),
     ("user", "I want to start running. Any tips for a beginner?"),
     ("assistant", "Great idea! Start slowly: alternate one minute of running with two minutes of walking for about 20 minutes, three times a week. Wear comfortable shoes, and increase your running time gradually."),
     ("user", "How fast should I run?"),
     ("assistant", "Run at a pace where you can still talk in full sentences. For beginners, an easy pace is more important than speed; it builds endurance and lowers the risk of injury.")],
    [("user", "我最近总是睡不好，有什么建议吗？"),
     ("assistant", "可以试试这些方法：每天固定时间上床和起床；睡前一小时少看手机；下午以后不喝咖啡和浓茶；保持卧室安静、黑暗。如果长期失眠，建议去医院咨询医生。"),
     ("user", "周末可以多睡一会儿吗？"),
     ("assistant", "可以稍微多睡一点，但最好不要比平时晚起超过一个小时，否则会打乱生物钟，周一反而更难早起。")],
    [("system", "你是一个编程助手。"),
     ("user", "Python 里怎么去掉列表中的重复元素？"),
     ("assistant", "如果不在乎顺序，可以用 list(set(xs))。如果想保持原来的顺序，可以用 list(dict.fromkeys(xs))。"),
     ("user", "那如果元素是字典呢？"),
     ("assistant", "字典不可哈希，不能直接放进集合。可以把每个字典转换成可哈希的形式作为判断依据，例如 tuple(sorted(d.items()))，用一个集合记录已经出现过的键，再按顺序保留第一次出现的字典。")],
    [("user", "Can you recommend a good way to learn vocabulary in a new language?"),
     ("assistant", "Use spaced repetition: review new words after one day, then three days, one week and one month. Learn words in context, for example in short sentences, and try to use them in your own writing or speech."),
     ("user", "How many new words per day is reasonable?"),
     ("assistant", "For most learners, 10 to 20 new words a day is sustainable. Consistency matters more than volume, so pick a number you can keep up every day.")],
    [("system", "You are a friendly travel assistant."),
     ("user", "What should I pack for a weekend hiking trip?"),
     ("assistant", "Essentials: comfortable hiking shoes, layered clothing, a rain jacket, water, snacks, a map or offline navigation app, sunscreen, a hat, a small first-aid kit and a power bank."),
     ("user", "Thanks! Anything special if it's in the mountains?"),
     ("assistant", "Yes: bring a warm layer because temperatures drop with altitude, check the weather forecast before you go, tell someone your route, and start early so you are back before dark.")],
    [("user", "什么是机器学习？"),
     ("assistant", "机器学习是让计算机从数据中自动学习规律，并用这些规律对新数据作出预测或决策的方法。"),
     ("user", "能举个生活中的例子吗？"),
     ("assistant", "比如邮箱的垃圾邮件过滤：系统从大量被标记为“垃圾”或“正常”的邮件中学习特征，之后就能自动判断新邮件是否是垃圾邮件。")],
    [("user", "Write a haiku about autumn."),
     ("assistant", "Crisp leaves drift and fall,\ngolden light on quiet paths,\nthe year breathes slowly.")],
    [("system", "你是一个耐心的数学老师。"),
     ("user", "为什么任何数乘以0都等于0？"),
     ("assistant", "乘法可以理解为重复相加。3乘以0表示“0个3相加”，什么都没有加，所以结果是0。也可以从分配律来看：a×0 = a×(0+0) = a×0 + a×0，两边同时减去a×0，就得到 a×0 = 0。")],
    [("user", "My code says 'IndexError: list index out of range'. What does that mean?"),
     ("assistant", "It means you tried to access a list position that doesn't exist. For a list of length n, valid indexes are 0 to n-1 (or -1 to -n). Check the loop bounds and make sure the list isn't empty before indexing."),
     ("user", "I used range(len(xs) + 1). Is that the problem?"),
     ("assistant", "Yes. range(len(xs) + 1) produces one index too many: the last value is len(xs), which is out of range. Use range(len(xs)), or better, iterate directly with for x in xs.")],
    [("user", "推荐一道简单的家常菜吧。"),
     ("assistant", "可以试试番茄炒蛋：鸡蛋打散炒到刚凝固盛出，再炒番茄出汁，加少许糖和盐，最后把鸡蛋倒回去翻匀即可。做法简单，酸甜可口。")],
    [("system", "You are a helpful assistant."),
     ("user", "Explain what an API is in simple terms."),
     ("assistant", "An API (application programming interface) is a set of rules that lets one program ask another program for data or services. Think of it like a restaurant menu: you choose from the listed options, and the kitchen prepares the result without you needing to know how it is cooked.")],
    [("user", "怎样才能坚持每天锻炼？"),
     ("assistant", "先从很小的目标开始，比如每天快走十五分钟；把运动安排在固定时间；找一个同伴互相督促；记录每天的完成情况。习惯养成后再逐渐增加强度。"),
     ("user", "如果某天实在没时间呢？"),
     ("assistant", "那就做一个“最小版本”，比如五分钟的拉伸或原地运动，重点是不要中断习惯。偶尔错过一天也没关系，第二天继续就好。")],
    [("user", "What is the boiling point of water at sea level?"),
     ("assistant", "At sea level, water boils at 100 degrees Celsius (212 degrees Fahrenheit). At higher altitudes it boils at a lower temperature because the air pressure is lower.")],
    [("system", "你是一个简洁的助手。"),
     ("user", "一年有几个季节？"),
     ("assistant", "通常分为四个季节：春、夏、秋、冬。"),
     ("user", "它们是怎么形成的？"),
     ("assistant", "主要是因为地轴倾斜。地球绕太阳公转时，南北半球轮流倾向太阳，阳光照射角度和白昼长短随之变化，于是形成了四季。")],
    [("user", "Please help me write a short thank-you note to my colleague for helping with a project."),
     ("assistant", "Hi Sam,\n\nThank you so much for your help on the project last week. Your quick feedback and careful testing made a real difference, and we finished on time because of it. I really appreciate it!\n\nBest regards,\nAlex")],
    [("user", "怎样向别人礼貌地拒绝一个请求？"),
     ("assistant", "可以先表示感谢和理解，再简单说明原因，最后尽可能提供替代方案。例如：“谢谢你想到我，不过这周我手头的工作实在排满了，没办法帮忙。如果下周还需要，我很乐意看看。”")],
    [("system", "You are a programming tutor."),
     ("user", "What does 'git commit' do?"),
     ("assistant", "git commit records a snapshot of the changes you have staged with git add into the repository history, together with a message describing them. It only affects your local repository; use git push to share commits with a remote."),
     ("user", "And how do I undo the last commit but keep my changes?"),
     ("assistant", "Run git reset --soft HEAD~1. This removes the last commit but keeps its changes staged, so you can edit them and commit again.")],
    [("user", "请介绍一下中秋节。"),
     ("assistant", "中秋节在农历八月十五，是中国重要的传统节日。这天月亮通常又圆又亮，象征团圆。人们会和家人一起赏月、吃月饼，各地还有提灯笼、猜灯谜等习俗。")],
    [("user", "Is it safe to leave cooked rice at room temperature overnight?"),
     ("assistant", "It's better not to. Cooked rice can grow bacteria that produce toxins when left at room temperature for a long time. Cool leftover rice quickly, refrigerate it within about an hour or two, and eat it within a day, reheating it until it is steaming hot.")],
    [("user", "帮我想一个学习计划的标题。"),
     ("assistant", "可以叫“每天进步一点点：三十天学习计划”。如果你告诉我学习的科目，我可以帮你想得更具体。"),
     ("user", "是学英语的。"),
     ("assistant", "那可以叫“三十天英语打卡计划：每天二十分钟，听说读写全面练”。")],
]

# Hand-written DPO pairs (prompt, chosen, rejected).
HAND_DPO = [
    ("What is the largest planet in our solar system?", "Jupiter is the largest planet in our solar system.", "Saturn is the largest planet in our solar system."),
    ("太阳从哪个方向升起？", "太阳从东方升起。", "太阳从西方升起。"),
    ("How many days are there in a leap year?", "A leap year has 366 days.", "A leap year has 365 days."),
    ("水在标准大气压下的沸点是多少摄氏度？", "在标准大气压下，水的沸点是100摄氏度。", "在标准大气压下，水的沸点是90摄氏度。"),
    ("Can you help me with my homework?", "Of course! Tell me which subject and which question you're working on, and we'll go through it step by step.", "No. Do your own homework."),
    ("能帮我看看这段代码哪里错了吗？", "当然可以，请把代码和报错信息发给我，我帮你一起分析。", "看不懂，自己查去。"),
    ("How many legs does a spider have?", "A spider has eight legs.", "A spider has six legs."),
    ("一周有几天？", "一周有七天。", "一周有五天。"),
    ("What is H2O?", "H2O is the chemical formula for water: two hydrogen atoms bonded to one oxygen atom.", "H2O is the chemical formula for salt."),
    ("我考试没考好，很难过。", "很抱歉听到这个消息，难过是很正常的。可以先休息一下，再看看哪些地方出了问题，下次有针对性地准备。需要的话我可以帮你一起分析。", "那是你自己不努力。"),
    ("Which is heavier: a kilogram of iron or a kilogram of feathers?", "They weigh the same: both are one kilogram.", "A kilogram of iron is heavier."),
    ("中国的首都是哪里？", "中国的首都是北京。", "中国的首都是上海。"),
]

# -------------------------------------------------------------------- helpers

def key(d):
    return json.dumps(d, ensure_ascii=False, sort_keys=True)


def unique_add(out, seen, rec):
    k = key(rec)
    if k in seen:
        return False
    seen.add(k)
    out.append(rec)
    return True


def instr_record(r, lang, prompt, answer):
    # Half the time split the prompt into instruction + input for variety.
    if r.random() < 0.3 and ("：" in prompt or ": " in prompt):
        sep = "：" if "：" in prompt else ": "
        head, tail = prompt.split(sep, 1)
        return {"instruction": head, "input": tail, "output": answer}
    return {"instruction": prompt, "input": "", "output": answer}


def conv_record(r, turns, sharegpt):
    if sharegpt:
        m = {"system": "system", "user": "human", "assistant": "gpt"}
        return {"conversations": [{"from": m[ro], "value": c} for ro, c in turns]}
    return {"conversations": [{"role": ro, "content": c} for ro, c in turns]}


def build(r):
    # --- SFT instructions
    instr, seen = [], set()
    for ins, inp, out in HAND_INSTR:
        unique_add(instr, seen, {"instruction": ins, "input": inp, "output": out})
    while len(instr) < 260:
        lang, p, c, _ = r.choice(TASKS)(r)
        unique_add(instr, seen, instr_record(r, lang, p, c))

    # --- SFT conversations
    conv, seen = [], set()
    for i, turns in enumerate(HAND_CONV):
        unique_add(conv, seen, conv_record(r, turns, sharegpt=(i % 4 == 3)))
    while len(conv) < 150:
        n_turns = r.choice([1, 2, 2, 3])
        lang = r.choice(["en", "zh"])
        turns = []
        if r.random() < 0.5:
            sp = [s for s in SYSTEM_PROMPTS if (lang == "zh") == any("\u4e00" <= ch <= "\u9fff" for ch in s)]
            turns.append(("system", r.choice(sp)))
        while sum(1 for t in turns if t[0] == "user") < n_turns:
            l2, p, c, _ = r.choice(TASKS)(r)
            if l2 == lang:
                turns += [("user", p), ("assistant", c)]
        unique_add(conv, seen, conv_record(r, turns, sharegpt=r.random() < 0.35))

    # --- DPO
    dpo, seen = [], set()
    for p, c, w in HAND_DPO:
        unique_add(dpo, seen, {"prompt": p, "chosen": c, "rejected": w})
    while len(dpo) < 250:
        _, p, c, w = r.choice(TASKS)(r)
        if c != w:
            unique_add(dpo, seen, {"prompt": p, "chosen": c, "rejected": w})
    while len(dpo) < 310:  # multi-turn: prior turns end with the user message
        lang = r.choice(["en", "zh"])
        turns = []
        if r.random() < 0.4:
            turns.append({"role": "system", "content": r.choice(SYSTEM_PROMPTS[:2] if lang == "en" else SYSTEM_PROMPTS[2:])})
        while True:
            l2, p, c, w = r.choice(TASKS)(r)
            if l2 != lang:
                continue
            if len([t for t in turns if t["role"] == "user"]) < 1:
                turns += [{"role": "user", "content": p}, {"role": "assistant", "content": c}]
                continue
            if c != w:
                turns.append({"role": "user", "content": p})
                break
        unique_add(dpo, seen, {"conversations": turns, "chosen": c, "rejected": w})
    return instr, conv, dpo


def write(path, rows):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"{len(rows):4d} records -> {os.path.relpath(path, DATA)}")


def main():
    r = random.Random(SEED)
    instr, conv, dpo = build(r)
    write(os.path.join(DATA, "sft", "sft_instructions.jsonl"), instr)
    write(os.path.join(DATA, "sft", "sft_conversations.jsonl"), conv)
    write(os.path.join(DATA, "dpo", "dpo_pairs.jsonl"), dpo)


if __name__ == "__main__":
    main()
